"""A :class:`Contestant` is one way of running a full training step, timed by the benchmark.

Either a tandem strategy (built through :func:`tandem.strategies.base.create_strategy` only)
or a plain-torch baseline. Each owns its copy of the model, optimizer and batch, so
contestants can be interleaved step by step without sharing state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
from torch import nn
from tandem.precision import Precision

__all__ = ["COMPILED", "Contestant", "TrainStep", "synthetic_batch", "module_tensors",
           "strategy_contestant", "skipped", "place"]

COMPILED = "+compile"  # suffix of a contestant's compiled twin ("single+compile")


@dataclass
class Contestant:
    """One column of the race: ``step()`` runs a full training step and returns its loss.

    ``step`` is ``None`` when ``skipped`` (why it cannot run here) or ``failure`` (why building
    broke). ``counts_traffic``: tandem's engine records the bytes moved; ``uncounted_traffic``
    names traffic left to torch, which that count misses.
    """

    name: str
    kind: str  # "strategy" or "baseline"
    devices: list[torch.device]
    step: Callable[[], torch.Tensor] | None = None
    own_tensors: Callable[[], Iterable[torch.Tensor]] = lambda: ()
    counts_traffic: bool = False
    uncounted_traffic: str | None = None
    skipped: str | None = None
    failure: str | None = None
    close: Callable[[], None] = lambda: None
    notes: list[str] = field(default_factory=list)


def skipped(name: str, kind: str, devices, reason: str) -> Contestant:
    """A contestant that appears in the table as ``skipped: reason``."""
    return Contestant(name=name, kind=kind, devices=list(devices), skipped=reason)


def synthetic_batch(batch_size: int, image_size: int, num_classes: int,
                    seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed random CPU batch, images ``(B, 3, S, S)`` and class targets, reused every step.

    The benchmark thus times the training step, not a data loader.
    """
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(batch_size, 3, image_size, image_size, generator=generator)
    targets = torch.randint(0, num_classes, (batch_size,), generator=generator)
    return images, targets


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

    def __init__(self, forward_loss: Callable[[], torch.Tensor], params, device: torch.device,
                 amp: Precision, lr: float):
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


def place(model: nn.Module, images: torch.Tensor, targets: torch.Tensor,
          device: torch.device, channels_last: bool):
    """Move the batch to ``device``; with ``channels_last`` convert the model and the images."""
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        images = images.to(device).contiguous(memory_format=torch.channels_last)
    else:
        images = images.to(device)
    return model, images, targets.to(device)


def strategy_contestant(name: str, model: nn.Module, devices: list[torch.device],
                        batch: tuple[torch.Tensor, torch.Tensor], *, amp: Precision, lr: float,
                        channels_last: bool = False, sync_bn: bool = False,
                        buffers: str = "replica0", compiled: bool = False,
                        compile_mode: str | None = None) -> Contestant:
    """Build tandem strategy ``name`` on ``devices`` around ``model`` (which it takes over).

    ``compiled`` builds the ``<name>+compile`` twin, compiled as ``tandem train --compile`` does.
    """
    from tandem.strategies.base import create_strategy
    from tandem.strategies.compile import compile_model

    strategy = create_strategy(name, devices, sync_bn=sync_bn, buffers=buffers).launch()
    model, images, targets = place(model, *batch, strategy.device, channels_last)
    if compiled:
        model = compile_model(strategy, model, compile_mode)
    wrapped = strategy.setup(model)
    criterion = nn.CrossEntropyLoss()

    def forward_loss() -> torch.Tensor:
        return strategy.forward_loss(wrapped, criterion, images, targets).loss

    step = TrainStep(forward_loss, wrapped.parameters(), strategy.device, amp, lr)
    # A ddp worker holds one device of the list; the others are other processes' business.
    timed_on = list(strategy.devices) if strategy.world_size == 1 else [strategy.device]
    uncounted = None
    if isinstance(wrapped, nn.parallel.DistributedDataParallel) and strategy.world_size > 1:
        uncounted = "torch DDP's gradient all-reduce"
    return Contestant(
        name=name + (COMPILED if compiled else ""), kind="strategy", devices=timed_on, step=step,
        own_tensors=lambda: module_tensors(wrapped, step.optimizer, images, targets),
        counts_traffic=True, uncounted_traffic=uncounted, close=strategy.close,
    )
