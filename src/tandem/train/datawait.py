"""How long the training loop waits for its data: time inside the loader's ``next()`` is the
data wait, the rest the step (host clock, no device sync); the first batch is timed apart."""

from __future__ import annotations

import time
from typing import Iterable, Iterator

WAIT_SHARE_WARNING = 0.2  # a data share above this, once in a run, earns one advice line
# the metrics row's clock readings: they differ run to run (a resume's comparison drops them)
TIMING_FIELDS = ("seconds", "images_per_sec", "data_seconds", "step_seconds",
                 "first_batch_seconds", "data_share")


class DataWait:
    """The data wait and step time of the epoch under way, and the run's one advice line."""

    def __init__(self, clock=None):
        self.clock = clock or time.perf_counter  # a test may hand its own
        self.advised = False  # the advice is given once per run
        self.start_epoch()

    def start_epoch(self) -> None:
        """Zero the epoch's sums (the run's ``advised`` stays)."""
        self.data = 0.0  # waits for batches after the first
        self.step = 0.0  # from each batch's arrival to the next request
        self.first: float | None = None  # the epoch's first wait (None: no batch yet)
        self.batches = 0

    def timed(self, loader: Iterable) -> Iterator:
        """``loader``'s batches, each wait and each step added to the epoch's sums."""
        it = iter(loader)  # workers start (or refill) here: part of the first wait
        asked = self.clock()
        while True:
            try:
                batch = next(it)
            except StopIteration:
                return
            got = self.clock()
            if self.first is None:
                self.first = got - asked
            else:
                self.data += got - asked
            self.batches += 1
            try:
                yield batch
            finally:  # also when the loop stops early (--max-steps) and closes this
                asked = self.clock()
                self.step += asked - got

    @property
    def share(self) -> float | None:
        """The data wait's share of (wait + step) after the first batch; None before a step."""
        total = self.data + self.step
        return self.data / total if self.batches > 1 and total > 0 else None

    def fields(self) -> dict:
        """The metrics row's figures of the epoch (none when no batch was timed)."""
        if self.first is None:
            return {}
        share = self.share
        return {"data_seconds": self.data, "step_seconds": self.step,
                "first_batch_seconds": self.first,
                "data_share": None if share is None else round(share, 4)}

    def advice(self, workers: int, device_type: str, decode_flag: bool) -> str | None:
        """One line, the first time the data share passes :data:`WAIT_SHARE_WARNING`."""
        share = self.share
        if self.advised or share is None or share <= WAIT_SHARE_WARNING:
            return None
        self.advised = True
        remedies = [f"more loader workers (-j {max(2, 2 * workers)}; now -j {workers})"]
        if device_type == "cuda" and decode_flag:
            remedies.append("JPEG decoding on the GPU (--decode gpu)")
        return (f"note: the training step waited for data {share:.0%} of the time "
                f"(data_seconds in metrics.jsonl); the input pipeline is the limit: try "
                + " or ".join(remedies))
