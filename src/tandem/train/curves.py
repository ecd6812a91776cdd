"""``curves.png``: training and validation loss, and validation accuracy, against epoch."""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")  # files only: never needs a display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

__all__ = ["plot_curves"]


def plot_curves(records: list[dict], path: str) -> None:
    """Draw loss and accuracy per epoch; a partial epoch is plotted at its epoch number.

    Written to a temporary name and renamed, so a reader never sees half a PNG.
    """
    epochs = [r["epoch"] for r in records]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    ax_loss.plot(epochs, [r["train_loss"] for r in records], "o-", label="train")
    ax_loss.plot(epochs, [r["val_loss"] for r in records], "o-", label="validation")
    ax_loss.set(xlabel="epoch", ylabel="loss", title="loss")
    ax_acc.plot(epochs, [r.get("train_acc") for r in records], "o-", label="train")
    ax_acc.plot(epochs, [r["val_acc"] for r in records], "o-", label="validation top-1")
    if any(r.get("val_acc5") is not None for r in records):  # rows before top-5 have none
        ax_acc.plot(epochs, [r.get("val_acc5") for r in records], "s--",
                    label="validation top-5")
    ax_acc.set(xlabel="epoch", ylabel="accuracy (%)", title="accuracy")
    for ax in (ax_loss, ax_acc):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # whole epochs only
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)
