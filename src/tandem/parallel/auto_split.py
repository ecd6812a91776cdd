"""``--split auto``'s decision: move the weights to the measured speeds only beyond the noise."""

from __future__ import annotations

import math
from typing import Sequence

from tandem.errors import UsageError

from .shares import shares

# two-sided 99.9% Student t quantiles by degrees of freedom (the largest key not above applies)
_T999 = {1: 636.6, 2: 31.6, 3: 12.92, 4: 8.61, 5: 6.87, 6: 5.96, 7: 5.41, 8: 5.04, 9: 4.78,
         10: 4.59, 12: 4.32, 15: 4.07, 20: 3.85, 25: 3.73, 30: 3.65, 60: 3.46}


class AutoSplit:
    """Weights that follow the devices' measured speeds over the steps since they last moved
    (at most ``window``). From ``warmup`` steps on they move only when the slowest device's
    chunks took longer than the fastest's by a paired t-test at 99.9% and by more than
    ``threshold`` (waived at a new epoch's first step): equal devices under a noisy clock keep
    an even split, a real difference moves it in a few steps.
    """

    def __init__(self, devices: int, *, warmup: int = 2, window: int = 32, threshold: float = 0.1):
        self.weights = [1.0] * devices
        self.warmup, self.window, self.threshold = warmup, window, threshold
        self.seen = 0  # steps observed
        # per observed step with every device busy: (log seconds per sample, log samples)
        self.steps: list[tuple[list[float], list[float]]] = []
        self.imbalance = 0.0  # slowest over fastest mean chunk time, minus 1, of self.steps
        self.epoch: int | None = None  # the epoch under way (at_epoch)
        self.force = False  # a new epoch began: no hysteresis at the next adjust

    def at_epoch(self, epoch: int) -> None:
        """Say which epoch is under way; a new one waives the next :meth:`adjust`'s threshold."""
        if self.epoch is not None and epoch != self.epoch:
            self.force = True
        self.epoch = epoch

    def observe(self, sizes: Sequence[int], seconds: Sequence[float]) -> None:
        """One step: ``sizes[i]`` samples took device ``i`` ``seconds[i]`` (kept only if every
        device had samples and time)."""
        self.seen += 1
        if len(sizes) != len(self.weights) or any(n <= 0 or t <= 0 for n, t in zip(sizes, seconds)):
            return
        self.steps.append(([math.log(t / n) for n, t in zip(sizes, seconds)],
                           [math.log(n) for n in sizes]))
        del self.steps[:-self.window]

    def target(self) -> list[float]:
        """Speeds (samples per second): the geometric mean over the kept steps."""
        k = len(self.steps)
        return [math.exp(-sum(s[0][i] for s in self.steps) / k) for i in range(len(self.weights))]

    def _beyond_noise(self) -> bool:
        """The paired t-test between the slowest and the fastest device's log chunk times."""
        k = len(self.steps)
        chunk = [[p + n for p, n in zip(*s)] for s in self.steps]
        means = [sum(c[i] for c in chunk) / k for i in range(len(self.weights))]
        slow = max(range(len(means)), key=means.__getitem__)
        fast = min(range(len(means)), key=means.__getitem__)
        gap = means[slow] - means[fast]
        self.imbalance = math.exp(gap) - 1
        if gap <= 0 or (not self.force and self.imbalance <= self.threshold):
            return False
        diffs = [c[slow] - c[fast] for c in chunk]
        var = sum((d - gap) ** 2 for d in diffs) / (k - 1)
        return var == 0 or gap / math.sqrt(var / k) > _T999[max(d for d in _T999 if d < k)]

    def adjust(self, batch: int | None = None) -> bool:
        """Move the weights to the speeds when beyond the noise (with ``batch``: only when its
        :func:`shares` change); whether they moved."""
        if self.seen < self.warmup or len(self.steps) < 2 or not self._beyond_noise():
            return False
        self.force = False
        target = self.target()
        new = [round(t / sum(target), 6) for t in target]
        if new == self.weights or (batch is not None
                                   and shares(batch, new) == shares(batch, self.weights)):
            return False
        self.weights = new
        self.steps = []  # the new split is judged by its own steps
        return True

    def state_dict(self) -> dict:
        return {"weights": list(self.weights), "steps": [[list(p), list(n)] for p, n in self.steps],
                "seen": self.seen, "imbalance": self.imbalance, "epoch": self.epoch,
                "force": self.force}

    def load_state_dict(self, state: dict) -> None:
        if len(state["weights"]) != len(self.weights):
            raise UsageError(f"the checkpoint's split has {len(state['weights'])} shares for "
                             f"{len(self.weights)} device(s)")
        self.weights = [float(w) for w in state["weights"]]
        self.steps = [([float(v) for v in p], [float(v) for v in n])
                      for p, n in state.get("steps", [])]
        self.seen, self.imbalance = int(state["seen"]), float(state["imbalance"])
        self.epoch, self.force = state.get("epoch"), bool(state.get("force", False))
