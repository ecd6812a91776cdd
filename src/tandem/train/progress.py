"""The per-epoch progress bar (tqdm) and the plain-text fallback for logs. The meter is read
only when shown: every ``print_freq`` batches, or each ``refresh`` seconds of the bar."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

from .metrics import MIXED_WORDS

class Progress:
    """Shows loss, accuracy and images/s (the job's) while an epoch trains: a tqdm bar on a
    terminal (``bar``; this process's values, after ``scope``), else a line every
    ``print_freq`` batches. ``wait``: a :class:`~.datawait.DataWait`, shown as ``data 62%``;
    ``mixed``: the targets are mixup's or cutmix's (:data:`~.metrics.MIXED_WORDS`)."""

    def __init__(self, total: int, initial: int, desc: str, *, bar: bool, print_freq: int = 0,
                 refresh: float = 1.0, scope: str = "", wait=None, mixed: bool = False):
        self.desc, self.scope, self.total = desc, scope, total
        self.print_freq, self.refresh, self.images = print_freq, refresh, 0
        self.start = time.perf_counter()
        self.shown = float("-inf")  # the bar shows values from the first batch on
        bar = bar and sys.stderr.isatty()  # a log file would keep every \r frame
        self.bar = tqdm(total=total, initial=initial, desc=desc, unit="batch", dynamic_ncols=True,
                        leave=True, file=sys.stderr) if bar else None
        self.batch, self.wait, self.mixed = initial, wait, mixed
        self.shares = ""  # the devices' shares of a batch, once --split auto moved them

    def note(self, line: str) -> None:
        """Print ``line`` now (above the bar when there is one); ``shares`` shows it after."""
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, flush=True)

    def update(self, images: int, meter) -> bool:
        """Count a batch; show ``meter`` when due, True then (one sync: ``finite`` is free)."""
        self.images += images
        self.batch += 1
        now = time.perf_counter()
        if self.bar is not None:
            self.bar.update(1)  # the count: tqdm redraws it at its own pace
            if now - self.shown < self.refresh and self.batch < self.total:
                return False
            self.shown = now
            self.bar.set_postfix_str(self.scope + self._values(meter, now), refresh=False)
            return True
        if self.print_freq and self.batch % self.print_freq == 0:
            print(f"{self.desc} [{self.batch}/{self.total}] {self._values(meter, now)}", flush=True)
            return True
        return False

    def _values(self, meter, now: float) -> str:
        rate = self.images / max(now - self.start, 1e-9)
        shares = f" split {self.shares}" if self.shares else ""
        share = None if self.wait is None else self.wait.share
        data = "" if share is None else f" data {share:.0%}"
        loss, acc = MIXED_WORDS if self.mixed else ("", "")
        return (f"loss {meter.loss:.4f}{loss} acc{acc} {meter.acc:.2f}% acc5 {meter.acc5:.2f}% "
                f"{rate:.0f} img/s{data}{shares}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
