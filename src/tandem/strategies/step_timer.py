"""A small step timer: build one training step of a strategy, time rounds of it, summarise.

``--strategy auto`` races its candidates with it (:mod:`.auto`), and ``tandem bench`` builds
its strategy contestants on it, so both time the same step. :class:`StrategyStep` is one full
training step (forward, loss, backward, SGD with momentum, in the run's precision) of a
strategy launched on its devices around a model it takes over, on a fixed batch that each
rank takes its share of. :func:`interleave` runs steps round by round, the order rotating every
round so that a busy machine's noise falls on every candidate alike; the clock is read only
after :func:`~tandem.parallel.work_clock.synchronize`. :func:`summarize` gives the median and
quartiles.

``torch.utils.benchmark.Timer`` measures one statement in blocks it sizes itself
(``blocked_autorange``) and reports the same median and interquartile range; it times one
candidate at a time, though, so the minutes a neighbour's job takes land on whichever ran
then. Interleaving candidates round by round is what lets a race on a shared machine compare
them, so the rounds are ours and the statistics are the usual ones.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Sequence

import torch
from torch import nn

from tandem.errors import first_line
from tandem.parallel.split import shares
from tandem.parallel.work_clock import synchronize
from tandem.precision import Precision

from . import compile as compiling
from .base import Strategy, create_strategy

__all__ = ["TrainStep", "StrategyStep", "Placed", "placed", "launched", "Lane", "interleave", "summarize", "Stats", "clock",
           "rank_share", "timed_devices", "describe", "module_tensors", "place"]


def clock() -> float:
    """A monotonic wall clock in seconds (what a user waiting for a step experiences)."""
    return time.perf_counter()


@dataclass(frozen=True)
class Stats:
    """Median and spread of a sample of step times, in seconds."""

    median: float
    q1: float
    q3: float
    iqr: float
    min: float
    max: float
    mean: float
    n: int

    def as_dict(self) -> dict:
        return asdict(self)


def summarize(samples: Sequence[float]) -> Stats:
    """Median, quartiles (inclusive), min, max and mean; an empty sample is a ``ValueError``."""
    if not samples:
        raise ValueError("no timed steps to summarize")
    values = sorted(float(s) for s in samples)
    if len(values) == 1:
        q1 = q3 = values[0]
    else:
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return Stats(median=statistics.median(values), q1=q1, q3=q3, iqr=q3 - q1,
                 min=values[0], max=values[-1], mean=statistics.fmean(values), n=len(values))


def module_tensors(module: nn.Module, optimizer: torch.optim.Optimizer | None,
                   *extra: torch.Tensor) -> Iterable[torch.Tensor]:
    """Parameters, their gradients, buffers, optimizer state tensors and ``extra`` tensors."""
    for param in module.parameters():
        yield param
        if param.grad is not None:
            yield param.grad
    yield from module.buffers()
    if optimizer is not None:
        for state in optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))
    yield from extra


class TrainStep:
    """A full training step around ``forward_loss()``; SGD, momentum 0.9, weight decay 1e-4,
    in ``amp``'s autocast (with a ``GradScaler`` where it scales)."""

    def __init__(self, forward_loss: Callable[[], torch.Tensor], params, amp: Precision,
                 lr: float):
        self.forward_loss = forward_loss
        self.optimizer = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=1e-4)
        self.amp = amp  # as in tandem train: tandem.precision decides dtype and scaling
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
    """This rank's share of the global batch now (as the strategy's shares say); the whole
    batch in a single process."""
    if strategy.world_size == 1:
        return images, targets
    n = len(targets)
    sizes = strategy.split.sizes(n) or shares(n, (1.0,) * strategy.world_size)
    lo = sum(sizes[:strategy.rank])
    return images[lo:lo + sizes[strategy.rank]], targets[lo:lo + sizes[strategy.rank]]


def timed_devices(strategy: Strategy) -> list[torch.device]:
    """The devices to synchronise around a step: a ddp worker holds one device of the list;
    the others are other processes' business."""
    return list(strategy.devices) if strategy.world_size == 1 else [strategy.device]


def place(model: nn.Module, images: torch.Tensor, targets: torch.Tensor,
          device: torch.device, channels_last: bool):
    """Move the batch to ``device``; with ``channels_last`` convert the model and the images."""
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        images = images.to(device).contiguous(memory_format=torch.channels_last)
    else:
        images = images.to(device)
    return model, images, targets.to(device)


@dataclass
class Placed:
    """A strategy built but not launched, and a model and batch on its device: what a
    candidate holds before any collective (a race agrees here that every rank got this far,
    out of memory being a rank's own failure)."""

    strategy: Strategy
    model: nn.Module
    images: torch.Tensor
    targets: torch.Tensor
    compiled: bool = False
    compile_mode: str | None = None

    def launch(self):
        """``(strategy, wrapped, images, targets)``: the strategy launched (joining its
        group: every rank meets there), the model compiled if asked and set up in it."""
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
    """Strategy ``name`` built on ``devices`` (not launched) and ``model`` (which it takes
    over) with the batch on its device. ``compiled`` compiles as ``tandem train --compile``
    does, at launch; ``split`` is ``--split``; ``split_clock`` its clock (``None``: the wall
    clock); ``options`` the model options a strategy may take (hybrid's head);
    ``agreement`` the job's (:mod:`tandem.distributed.agree`)."""
    extra = {} if split is None else {"split": split, "split_clock": split_clock}
    strategy = create_strategy(name, devices, sync_bn=sync_bn, buffers=buffers, options=options,
                               agreement=agreement, **extra)
    model, images, targets = place(model, *batch, strategy.device, channels_last)
    return Placed(strategy, model, images, targets, compiled, compile_mode)


def launched(name: str, model: nn.Module, devices: list[torch.device],
             batch: tuple[torch.Tensor, torch.Tensor], **setup):
    """:func:`placed`, then launched: ``(strategy, wrapped, images, targets)``."""
    return placed(name, model, devices, batch, **setup).launch()


class StrategyStep:
    """One training step of a launched ``strategy`` around its set-up model (``wrapped``) on
    the global batch (``images``, ``targets``; a rank of a multi-process strategy takes its
    share at every step). :meth:`build` launches one (:func:`launched`) first. :meth:`close`
    leaves the process group a multi-process strategy joined."""

    def __init__(self, strategy: Strategy, wrapped: nn.Module, images: torch.Tensor,
                 targets: torch.Tensor, *, amp: Precision, lr: float):
        self.strategy, self.model, self.images, self.targets = strategy, wrapped, images, targets
        self.criterion = nn.CrossEntropyLoss()
        self.train_step = TrainStep(self.forward_loss, self.model.parameters(), amp, lr)
        self.devices = timed_devices(self.strategy)

    @classmethod
    def build(cls, name: str, model: nn.Module, devices: list[torch.device],
              batch: tuple[torch.Tensor, torch.Tensor], *, amp: Precision, lr: float,
              **setup) -> "StrategyStep":
        """Strategy ``name`` launched on ``devices`` around ``model`` (which it takes over),
        and its step; ``setup``: :func:`placed`'s keywords."""
        return cls.start(placed(name, model, devices, batch, **setup), amp=amp, lr=lr)

    @classmethod
    def start(cls, ready: Placed, *, amp: Precision, lr: float) -> "StrategyStep":
        """The step of a :class:`Placed` candidate, launched now."""
        return cls(*ready.launch(), amp=amp, lr=lr)

    def forward_loss(self) -> torch.Tensor:
        x, y = rank_share(self.strategy, self.images, self.targets)
        return self.strategy.forward_loss(self.model, self.criterion, x, y,
                                          batch_size=len(self.targets)).loss

    def __call__(self) -> torch.Tensor:
        loss = self.train_step()
        self.strategy.split.step(0, 0)  # --split auto: every rank decides alike
        return loss

    def tensors(self) -> Iterable[torch.Tensor]:
        """What this step keeps on its devices: parameters, gradients, buffers, optimizer
        state and the batch."""
        return module_tensors(self.model, self.train_step.optimizer, self.images, self.targets)

    def close(self) -> None:
        self.strategy.close()


@dataclass
class Lane:
    """One candidate in :func:`interleave`: its step, the devices to synchronise around it,
    the times of its timed rounds, its first (untimed or not) step's time, and why it failed
    (``None`` while it runs)."""

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
    each round. A lane whose step raises is marked failed (``catch``) and skipped after;
    without ``catch`` the error propagates (torchrun ranks need that). ``around(lane, timed)``
    (a context manager factory) wraps each step, e.g. a traffic meter or a memory probe."""
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
