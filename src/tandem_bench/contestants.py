"""A :class:`Contestant` is one way of running a full training step, timed by the benchmark.

Either a tandem strategy (built through :func:`tandem.strategies.base.create_strategy` only)
or a plain-torch baseline. Each owns its copy of the model, optimizer and batch, so
contestants can be interleaved step by step without sharing state.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
from torch import nn

from tandem.distributed.agree import Agreement
from tandem.distributed.env import Environment, env_rank, read_env, split_clock
from tandem.hybrid.across_processes import DistributedHybrid
from tandem.parallel import context
from tandem.parallel.split import clock_from_spec
from tandem.precision import Precision
from tandem.strategies import strategy_class
from tandem.strategies.step_timer import StrategyStep, TrainStep, place, placed


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


class Handicap(nn.Module):
    """``model``, made ``factor`` times as slow per sample on replica or rank ``index``.

    The extra work is real and proportional to the chunk: ``factor - 1`` more passes over the
    replica's own chunk (a fraction of a pass over part of it) through a private copy of the
    model in eval mode, so the real model's batch-norm statistics, synchronisation and
    gradients are untouched. Each phase is slowed where it runs: the extra forwards in the
    replica's forward, their backward in the replica's backward (its own thread for ``dp``
    replicas, see :mod:`tandem.parallel.threaded_backward`), so a forward timed by
    ``--split auto`` is ``factor`` times as long too.
    """

    def __init__(self, model: nn.Module, index: int, factor: float):
        super().__init__()
        self.model, self.index, self.factor = model, index, factor
        # hidden from the module tree: no conversion to SyncBatchNorm, no state, no DDP
        object.__setattr__(self, "_shadow", copy.deepcopy(model).eval())

    def forward(self, x):
        out = self.model(x)
        if self.factor > 1 and x.shape[0] and _replica_index() == self.index:
            extra = self._extra_forward(x.detach())
            if extra is not None and out.requires_grad:
                out = _ThenBackward.apply(out, extra)
        return out

    def _extra_forward(self, x: torch.Tensor):
        """The extra forwards; returns their backward, to run in this replica's backward."""
        shadow = self._shadow
        ref = next(shadow.parameters())
        if ref.device != x.device or ref.dtype != x.dtype:
            shadow.to(x.device, x.dtype)
        whole, part = divmod(self.factor - 1, 1.0)
        chunks = [c for c in [x] * int(whole) + [x[:round(part * x.shape[0])]] if c.shape[0]]
        params = [p for p in shadow.parameters() if p.requires_grad]
        with torch.set_grad_enabled(torch.is_grad_enabled() and bool(params)):
            total = sum(shadow(chunk).float().sum() for chunk in chunks)
        if not isinstance(total, torch.Tensor) or not total.requires_grad:
            return None
        return lambda: torch.autograd.grad(total, params, allow_unused=True)


class _ThenBackward(torch.autograd.Function):
    """The identity, whose backward first runs ``extra`` (the handicap's backward work)."""

    @staticmethod
    def forward(ctx, x, extra):
        ctx.extra = extra
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        extra, ctx.extra = ctx.extra, None
        with torch.enable_grad():
            extra()
        return grad, None


def _replica_index() -> int:
    """This replica thread's index, else this process's rank (0 outside torchrun)."""
    here = context.current()
    return here.index if here is not None else env_rank(Environment.read())


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


def prepare_strategy(name: str, model: nn.Module, devices: list[torch.device],
                     batch: tuple[torch.Tensor, torch.Tensor], *,
                     handicap: tuple[int, float] | None = None, split=None, **setup):
    """Launch strategy ``name`` on ``devices`` and set ``model`` (which it takes over) up in it
    (:func:`~tandem.strategies.step_timer.placed`, whose keywords ``setup`` are);
    ``(strategy, wrapped, images, targets)``. ``split`` is ``--split`` (its clock the one
    ``TANDEM_SPLIT_CLOCK`` names); ``handicap`` ``(I, F)`` wraps the model in
    :class:`Handicap`."""
    if split is not None:
        setup.update(split=split, split_clock=clock_from_spec(split_clock(Environment.read())))
    if handicap is not None:
        model = Handicap(model, *handicap)
    if strategy_class(name).multiprocess:  # placed by torchrun's variables, read here
        env = read_env(Environment.read())
        setup.setdefault("agreement", Agreement(env.rank, env.world_size, node=env.node,
                                                addr=env.addr, env=env))
    return placed(name, model, devices, batch, **setup).launch()


def uncounted_traffic(strategy, wrapped: nn.Module) -> str | None:
    """Traffic left to torch, which the engine's count misses: DDP's gradient all-reduce (the
    hybrid across processes sums its trunk's through a comm hook that counts them) and the
    buffers DDP sends from rank 0 at every forward (``--buffers replica0``)."""
    if strategy.world_size < 2:
        return None
    if isinstance(wrapped, DistributedHybrid):
        ddp, missed = wrapped.dp, []
    elif isinstance(wrapped, nn.parallel.DistributedDataParallel):
        ddp, missed = wrapped, ["gradient all-reduce"]
    else:
        return None
    if strategy.buffers == "replica0" and next(ddp.module.buffers(), None) is not None:
        missed.append("buffer broadcast")
    return "torch DDP's " + " and ".join(missed) if missed else None


def strategy_contestant(name: str, model: nn.Module, devices: list[torch.device],
                        batch: tuple[torch.Tensor, torch.Tensor], *, amp: Precision, lr: float,
                        compiled: bool = False, **setup) -> Contestant:
    """Build tandem strategy ``name`` on ``devices`` around ``model`` (which it takes over):
    the step ``--strategy auto`` races (:class:`~tandem.strategies.step_timer.StrategyStep`).

    ``compiled`` builds a compiled twin; ``setup`` are :func:`prepare_strategy`'s
    keywords. ``batch`` is the global batch: a rank of a multi-process strategy takes its
    share of it at every step, as the strategy's shares say at that step.
    """
    step = StrategyStep(*prepare_strategy(name, model, devices, batch, compiled=compiled,
                                          **setup), amp=amp, lr=lr)
    return Contestant(
        name=name, kind="strategy", devices=step.devices, step=step,
        own_tensors=lambda: module_tensors(step.model, step.train_step.optimizer, step.images,
                                           step.targets),
        counts_traffic=True, uncounted_traffic=uncounted_traffic(step.strategy, step.model),
        close=step.close,
    )
