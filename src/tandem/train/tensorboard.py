"""TensorBoard scalars in ``RUN/tb`` (with the ``tensorboard`` package): each metrics row at
its step, rewritten from the rows a run keeps, so a resume never leaves a step twice."""

from __future__ import annotations

import math
import os

# metrics.jsonl key -> TensorBoard tag; a dict-valued entry becomes one scalar per key
TAGS = {
    "train_loss": "loss/train", "val_loss": "loss/val",
    "train_acc": "top1/train", "val_acc": "top1/val",
    "train_acc5": "top5/train", "val_acc5": "top5/val",
    "train_pixel_acc": "pixel_acc/train", "val_pixel_acc": "pixel_acc/val", "val_miou": "miou/val",
    "lr": "lr", "images_per_sec": "images_per_sec", "seconds": "epoch_seconds",
    "data_seconds": "time/data", "step_seconds": "time/step",
    "first_batch_seconds": "time/first_batch", "data_share": "data_share",
}


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class TensorBoard:
    """A ``SummaryWriter`` on ``RUN/tb`` fed one metrics row at a time, opened at the first."""

    def __init__(self, writer_class, path: str):
        self._writer_class, self.path, self.writer = writer_class, path, None

    @staticmethod
    def clear(path: str) -> None:
        """Remove the event files in ``path`` (nothing else there)."""
        if os.path.isdir(path):
            for name in os.listdir(path):
                if name.startswith("events.out.tfevents."):
                    os.remove(os.path.join(path, name))

    @classmethod
    def open(cls, path: str, rows: list[dict]) -> "TensorBoard | None":
        """The writer on ``path`` holding ``rows``; ``None`` without ``tensorboard``."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # the optional extra is not installed: say nothing, write nothing
            return None
        cls.clear(path)
        board = cls(SummaryWriter, path)
        for row in rows:
            board.add_row(row)
        return board

    def add_row(self, row: dict) -> None:
        """Write ``row``'s numbers at its ``step``; missing or non-finite ones are left out."""
        if self.writer is None:  # purge_step 0: a live TensorBoard drops what it had read
            self.writer = self._writer_class(self.path, purge_step=0)
        step = row.get("step")
        if not isinstance(step, int):
            return
        for key, value in row.items():
            if key in TAGS and _number(value):
                self.writer.add_scalar(TAGS[key], value, global_step=step)
            elif isinstance(value, dict):
                for name, number in value.items():
                    if _number(number):
                        self.writer.add_scalar(f"{key}/{name}", number, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
