"""The step ``--strategy auto`` races (:mod:`.auto`) and ``tandem bench`` times.

:class:`StrategyStep`: one full training step of a launched strategy on a fixed batch.
:func:`interleave` runs steps round by round, the order rotating so that a busy machine's noise
falls on every candidate alike; the clock is read only after
:func:`~tandem.parallel.work_clock.synchronize`.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn

from tandem.errors import first_line
from tandem.parallel.split import shares
from tandem.parallel.work_clock import synchronize
from tandem.precision import Precision

from . import compile as compiling
from .base import Strategy, create_strategy


def clock() -> float:
    """A monotonic wall clock in seconds (what a user waiting for a step experiences)."""
    return time.perf_counter()


def quartiles(samples: Sequence[float]) -> tuple[float, float, float]:
    """``(q1, median, q3)`` of ``samples`` (inclusive quartiles); empty: a ``ValueError``."""
    if not samples:
        raise ValueError("no timed steps to summarize")
    values = sorted(float(s) for s in samples)
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, statistics.median(values), q3


class TrainStep:
    """A full training step around ``forward_loss()``: SGD (momentum 0.9, weight decay 1e-4) in
    ``amp``'s autocast, with its ``GradScaler`` where it scales."""

    def __init__(self, forward_loss: Callable[[], torch.Tensor], params, amp: Precision, lr: float):
        self.forward_loss = forward_loss
        self.optimizer = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=1e-4)
        self.amp = amp
        self.scaler = amp.scaler() if amp.scaled else None

    def __call__(self) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        with self.amp.autocast():
            loss = self.forward_loss()
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            loss.backward()
            self.optimizer.step()
        return loss.detach()


def rank_share(strategy: Strategy, images: torch.Tensor, targets: torch.Tensor):
    """This rank's share of the global batch now (one process: the whole batch)."""
    if strategy.world_size == 1:
        return images, targets
    n = len(targets)
    sizes = strategy.split.sizes(n) or shares(n, (1.0,) * strategy.world_size)
    lo = sum(sizes[:strategy.rank])
    return images[lo:lo + sizes[strategy.rank]], targets[lo:lo + sizes[strategy.rank]]


def timed_devices(strategy: Strategy) -> list[torch.device]:
    """The devices to synchronise around a step (a ddp worker: its own only)."""
    return list(strategy.devices) if strategy.world_size == 1 else [strategy.device]


def place(model: nn.Module, images: torch.Tensor, targets: torch.Tensor,
          device: torch.device, channels_last: bool):
    """Move the batch to ``device``; with ``channels_last`` convert the model and the images."""
    images = images.to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        images = images.contiguous(memory_format=torch.channels_last)
    return model, images, targets.to(device)


@dataclass
class Placed:
    """A strategy built but not launched, with a model and batch on its device (out of memory
    here is a rank's own failure)."""

    strategy: Strategy
    model: nn.Module
    images: torch.Tensor
    targets: torch.Tensor
    compiled: bool = False
    compile_mode: str | None = None

    def launch(self):
        """``(strategy, wrapped, images, targets)``: the strategy launched (every rank meets),
        the model compiled if asked and set up in it."""
        strategy, model = self.strategy.launch(), self.model
        if self.compiled:
            compiling.check_compile(strategy, strategy.device.type)
            model = compiling.compiled(model, self.compile_mode)
        return strategy, strategy.setup(model), self.images, self.targets


def placed(name: str, model: nn.Module, devices: list[torch.device],
           batch: tuple[torch.Tensor, torch.Tensor], *, channels_last: bool = False,
           sync_bn: bool = False, buffers: str = "replica0", compiled: bool = False,
           compile_mode: str | None = None, split=None, split_clock=None,
           options: dict | None = None, agreement=None) -> Placed:
    """Strategy ``name`` built on ``devices`` around ``model`` (which it takes over), not
    launched, with the batch on its device; the keywords are ``tandem train``'s."""
    extra = {} if split is None else {"split": split, "split_clock": split_clock}
    strategy = create_strategy(name, devices, sync_bn=sync_bn, buffers=buffers, options=options,
                               agreement=agreement, **extra)
    model, images, targets = place(model, *batch, strategy.device, channels_last)
    return Placed(strategy, model, images, targets, compiled, compile_mode)


class StrategyStep:
    """One training step of a launched ``strategy`` around its set-up model on the global batch
    (a rank takes its share at every step); :meth:`close` closes the strategy."""

    def __init__(self, strategy: Strategy, wrapped: nn.Module, images: torch.Tensor,
                 targets: torch.Tensor, *, amp: Precision, lr: float):
        self.strategy, self.model, self.images, self.targets = strategy, wrapped, images, targets
        self.criterion = nn.CrossEntropyLoss()
        self.train_step = TrainStep(self.forward_loss, self.model.parameters(), amp, lr)
        self.devices = timed_devices(self.strategy)

    @classmethod
    def start(cls, ready: Placed, *, amp: Precision, lr: float) -> "StrategyStep":
        return cls(*ready.launch(), amp=amp, lr=lr)

    def forward_loss(self) -> torch.Tensor:
        x, y = rank_share(self.strategy, self.images, self.targets)
        return self.strategy.forward_loss(self.model, self.criterion, x, y,
                                          batch_size=len(self.targets)).loss

    def __call__(self) -> torch.Tensor:
        loss = self.train_step()
        self.strategy.split.step(0, 0)  # --split auto: every rank decides alike
        return loss

    def close(self) -> None:
        self.strategy.close()


@dataclass
class Lane:
    """One candidate in :func:`interleave`: its step, the devices to synchronise around it,
    its timed rounds, first step's time, last loss, and why it failed (or ``None``)."""

    name: str
    step: Callable[[], torch.Tensor] | None
    devices: Sequence[torch.device] = ()
    times: list[float] = field(default_factory=list)
    first_s: float | None = None
    failure: str | None = None
    loss: torch.Tensor | None = None


def describe(exc: BaseException) -> str:
    """``"Type: first line of the message"`` (a table cell, not a traceback)."""
    return f"{type(exc).__name__}: {first_line(exc)}"


def interleave(lanes: Sequence[Lane], rounds: int, warmup: int = 0, *, clock=clock,
               catch: bool = True, around: Callable | None = None) -> None:
    """``warmup`` untimed then ``rounds`` timed rounds of every lane's step, the order rotating
    each round. A lane whose step raises is marked failed and skipped after (``catch``), else
    the error propagates (torchrun ranks). ``around(lane, timed)``: a context around each step."""
    for r in range(warmup + rounds):
        shift = r % len(lanes) if lanes else 0
        for lane in [*lanes[shift:], *lanes[:shift]]:
            if lane.failure is not None:
                continue
            timed = r >= warmup
            try:
                _once(lane, timed, clock, around)
            except Exception as exc:
                if not catch:
                    raise
                lane.failure = describe(exc)


def _once(lane: Lane, timed: bool, clock, around) -> None:
    synchronize(lane.devices)
    with around(lane, timed) if around is not None else contextlib.nullcontext():
        start = clock()
        lane.loss = lane.step()
        synchronize(lane.devices)
        elapsed = clock() - start
    if lane.first_s is None:
        lane.first_s = elapsed
    if timed:
        lane.times.append(elapsed)
