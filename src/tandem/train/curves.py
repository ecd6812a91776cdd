"""``curves.png``: loss, accuracy and learning rate from the rows of ``metrics.jsonl``."""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# The learning rate at optimizer steps 0, 1, ...: (steps per epoch, lr of step -> float).
Schedule = tuple[int, Callable[[int], float]]


def positions(records: list[dict]) -> tuple[list[float], str]:
    """The x of each row and the axis' label: epochs, a partial epoch's row at the fraction
    of it trained; steps instead while the rows cover fewer than 2 epochs."""
    whole = [r["batches"] for r in records if not r.get("partial") and r.get("batches")]
    per_epoch = max(whole) if whole else None

    def epochs(r: dict) -> float:
        if r.get("partial") and per_epoch:
            return r["epoch"] - 1 + r["batches"] / per_epoch
        return r["epoch"] - (1 if r.get("partial") else 0)  # unknown fraction: its start

    xs = [epochs(r) for r in records]
    if max(xs, default=0) < 2:
        return [r.get("step", r["epoch"]) for r in records], "step"
    return xs, "epoch"


def _line(ax, xs, records, key, style, label):
    """Plot ``key`` against ``xs``; missing values (older rows, nulls) are left out."""
    pairs = [(x, r.get(key)) for x, r in zip(xs, records) if r.get(key) is not None]
    if pairs:
        ax.plot(*zip(*pairs), style, label=label)


def _used(records: list[dict]) -> dict[int, float] | None:
    """The lr each optimizer step used; ``None`` when no row records its steps."""
    if not any(r.get("lr_steps") for r in records):
        return None
    used = {r["step"]: r["lr"] for r in records
            if isinstance(r.get("step"), int) and r.get("lr") is not None}
    used.update((t, lr) for r in records for t, lr in r.get("lr_steps") or [])
    return used


def _used_line(ax, used: dict[int, float], unit: str, per_epoch: int) -> None:
    """The lr each step used (:func:`_used`)."""
    steps = sorted(used.items())
    xs = [float(t) if unit == "step" else t / max(1, per_epoch) for t, _ in steps]
    ax.plot(xs, [lr for _, lr in steps], "-", color="grey", label="used at each step")


def _schedule_line(ax, schedule: Schedule, records: list[dict], unit: str) -> None:
    """The lr of every step to the last row's: the rows' own up to the last one the schedule
    disagrees with, the schedule after it."""
    per_epoch, lr_of = schedule
    rows = sorted((r["step"], r["lr"]) for r in records
                  if isinstance(r.get("step"), int) and r.get("lr") is not None)
    if not rows:
        return
    other = [i for i, (t, lr) in enumerate(rows)
             if not math.isclose(lr_of(t), lr, rel_tol=1e-9, abs_tol=1e-12)]
    first = rows[other[-1]][0] if other else 0  # the schedule's first step drawn
    stride = max(1, (rows[-1][0] - first) // 500)
    steps = list(range(first, rows[-1][0] + 1, stride))
    xs = [float(t) if unit == "step" else t / max(1, per_epoch) for t in steps]
    ys = [lr_of(t) for t in steps]
    if other:  # the rows that an earlier schedule drove, joined up to where this one begins
        before = rows[:other[-1] + 1]
        xs = [float(t) if unit == "step" else t / max(1, per_epoch) for t, _ in before] + xs
        ys = [lr for _, lr in before] + ys
    ax.plot(xs, ys, "-", color="grey", label="schedule")


def build_figure(records: list[dict], title: str = "",
                 schedule: Schedule | None = None, classes: int | None = None) -> Figure:
    """Three panels (loss, accuracy, learning rate) of ``records``, titled ``title``. Top-5
    is left out for ``classes`` of 5 or fewer (it is 100% whatever the model does)."""
    # imported here: matplotlib takes about 0.7 s to import, and only the main process draws
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    xs, unit = positions(records)
    fig = Figure(figsize=(14, 4))
    ax_loss, ax_acc, ax_lr = fig.subplots(1, 3)
    _line(ax_loss, xs, records, "train_loss", "o-", "train")
    _line(ax_loss, xs, records, "val_loss", "o-", "validation")
    ax_loss.set(ylabel="loss (log scale)", title="loss")
    if any(r.get(k) for r in records for k in ("train_loss", "val_loss")):
        ax_loss.set_yscale("log")
        plain = FuncFormatter(lambda v, _: f"{v:g}")  # 0.5, not 5x10^-1
        ax_loss.yaxis.set_major_formatter(plain)
        ax_loss.yaxis.set_minor_formatter(plain)
    _line(ax_acc, xs, records, "train_acc", "o-", "train")
    _line(ax_acc, xs, records, "val_acc", "o-", "validation top-1")
    if classes is None or classes > 5:
        _line(ax_acc, xs, records, "val_acc5", "s--", "validation top-5")
    _line(ax_acc, xs, records, "val_miou", "d-", "validation mIoU")
    ax_acc.set(ylabel="accuracy (%)", title="accuracy")
    per_epoch = schedule[0] if schedule is not None else \
        max([r["batches"] for r in records if r.get("batches")], default=1)
    used, dots = _used(records), records
    if used is not None:
        _used_line(ax_lr, used, unit, per_epoch)
        # each row's dot on that line: the lr its next step used
        dots = [dict(r, lr=used.get(r.get("step"), r.get("lr"))) for r in records]
    elif schedule is not None:
        _schedule_line(ax_lr, schedule, records, unit)
    _line(ax_lr, xs, dots, "lr", "o", "at each row")
    ax_lr.set(ylabel="learning rate", title="learning rate")
    partial = [(x, r[k]) for x, r in zip(xs, records) if r.get("partial")
               for k in ("train_loss", "val_loss") if r.get(k) is not None]
    if partial:  # rings: rows of epochs stopped part-way (--max-steps)
        ax_loss.plot(*zip(*partial), "o", mfc="none", ms=12, color="grey", label="partial epoch")
    for ax in (ax_loss, ax_acc, ax_lr):
        ax.set_xlabel(unit)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlim(left=0)  # training starts at step 0, epoch 0
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_curves(records: list[dict], path: str, title: str | None = None,
                schedule: Schedule | None = None, classes: int | None = None) -> None:
    """Write :func:`build_figure` of ``records`` to ``path`` whole (no rows: removed)."""
    if not records:
        if os.path.exists(path):
            os.remove(path)
        return
    if title is None:
        title = os.path.basename(os.path.dirname(os.path.abspath(path)))
    tmp = path + ".tmp.png"
    build_figure(records, title, schedule, classes).savefig(tmp, dpi=100)
    os.replace(tmp, path)
