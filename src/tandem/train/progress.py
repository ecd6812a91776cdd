"""The per-epoch progress bar (tqdm) and the plain-text fallback for logs."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

__all__ = ["Progress"]


class Progress:
    """Shows loss, accuracy and images/s while an epoch trains.

    ``bar=True`` draws a tqdm bar on a terminal, else a line every ``print_freq`` batches.
    ``images`` passed to :meth:`update` are global, so images/s is the whole job's rate.
    """

    def __init__(self, total: int, initial: int, desc: str, *, bar: bool, print_freq: int = 0):
        self.desc = desc
        self.total = total
        self.print_freq = print_freq
        self.images = 0
        self.start = time.perf_counter()
        # A bar redraws itself with \r: only a terminal shows that, a log file would keep
        # every frame. Off a terminal, --print-freq lines and the epoch lines remain.
        bar = bar and sys.stderr.isatty()
        self.bar = tqdm(total=total, initial=initial, desc=desc, unit="batch", dynamic_ncols=True,
                        leave=True, file=sys.stderr) if bar else None
        self.batch = initial

    def update(self, images: int, loss: float, acc: float, acc5: float | None = None) -> None:
        self.images += images
        self.batch += 1
        rate = self.images / max(time.perf_counter() - self.start, 1e-9)
        accs = f"acc {acc:.2f}%" + ("" if acc5 is None else f" acc5 {acc5:.2f}%")
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {loss:.4f} {accs} {rate:.0f} img/s", refresh=False)
            self.bar.update(1)
        elif self.print_freq and self.batch % self.print_freq == 0:
            print(f"{self.desc} [{self.batch}/{self.total}] loss {loss:.4f} {accs} "
                  f"{rate:.0f} img/s", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
