"""The one interface every training strategy implements, and the registry that selects one.

One-process strategies' collectives are no-ops: the loop is the same for any of them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ClassVar

import torch
from torch import nn

from tandem import model_state
from tandem.distributed import faults
from tandem.distributed.agree import LOCAL, Agreement
from tandem.errors import UsageError
from tandem.parallel.split import BatchSplit
from tandem.suggest import did_you_mean
from tandem.plain_norms import PlainNorms

from .outputs import DEFAULT_IGNORE_INDEX, hits, pick_output, plain_ce_sum


@dataclass
class StepOutput:
    """What one forward+loss returns to the loop: ``loss``, the mean over this process's
    samples; top-1/top-5 hits ``correct``/``correct5`` (or None) over ``count`` samples; for
    dense outputs the ``confusion`` matrix (``correct`` then counts positions); ``ce_sum``, a
    label-smoothed validation's plain cross-entropy (:func:`.outputs.plain_ce_sum`)."""

    loss: torch.Tensor
    correct: torch.Tensor
    count: int
    correct5: torch.Tensor | None = None
    confusion: torch.Tensor | None = None
    ce_sum: torch.Tensor | None = None


class Strategy:
    """A way of running a training step on a set of devices.

    Subclasses set ``name`` and declare their abilities below; code outside asks those, never
    the name. Decisions all processes share go through ``agreement``
    (:mod:`tandem.distributed.agree`).
    """

    name: ClassVar[str] = ""
    #: one process per device, started by torchrun (``tandem launch``)
    multiprocess: ClassVar[bool] = False
    #: devices one process drives (``None``: as many as it is given)
    max_devices: ClassVar[int | None] = None
    #: its optimizer state loads under any other strategy (not so for sharded layers)
    portable_optimizer_state: ClassVar[bool] = True
    #: the one-device reference every other strategy must match
    reference: ClassVar[bool] = False
    #: ``--split`` sets how much of each batch its devices (or ranks) take
    splits_batch: ClassVar[bool] = False
    #: the one-process strategy whose update it computes with a process per device
    across_processes_of: ClassVar[str | None] = None
    #: its model's state is gathered from every rank: survivors of a lost peer cannot save it
    state_needs_every_rank: ClassVar[bool] = False
    #: what a lost peer does to the survivors' collectives (:mod:`tandem.distributed.faults`)
    failure_model: str = faults.RAISES
    #: one process runs a replica per device in threads (``--backward-threads`` applies)
    replica_threads: ClassVar[bool] = False
    #: ``--grad-compression`` may compress its data-parallel gradients
    #: (:mod:`tandem.distributed.compression`)
    compresses_gradients: ClassVar[bool] = False
    #: the hook's state where it compresses them (set up with the model), else ``None``
    compressor = None

    #: the model options (:class:`~tandem.config.ModelConfig` fields) kept in ``self.options``
    model_options: ClassVar[tuple[str, ...]] = ()
    #: why ``--compile`` cannot be used with it (``None``: the model it is given may be compiled)
    compile_unsupported: ClassVar[str | None] = None

    @classmethod
    def takes_any_model(cls) -> bool:
        """Whether it keeps the base :meth:`check_model`, which asks for nothing."""
        return cls.check_model.__func__ is Strategy.check_model.__func__

    @classmethod
    def check_model(cls, model: nn.Module, **options) -> str | None:
        """``None`` if it can train ``model`` (``options``: of :attr:`model_options`), else what
        it needs (one line)."""
        return None

    def __init__(self, devices: list[torch.device], *, sync_bn: bool = False,
                 buffers: str = "replica0", output_key: str | int | None = None,
                 options: dict | None = None, split=None, max_share: int | None = None,
                 backward_threads: bool | None = None, split_clock: Callable | None = None,
                 agreement: Agreement | None = None):
        self.devices = list(devices)
        self.agreement = agreement or LOCAL  # a multi-process one outside a Job makes its own
        self.sync_bn = sync_bn
        self.buffers = buffers
        self.output_key = output_key  # picks the logits of a dict or tuple output
        self.options = {k: (options or {}).get(k) for k in self.model_options}
        # --split/--max-share, one share per device (ranks: see ddp); split_clock: a test clock
        self.split = BatchSplit(split, len(self.devices), max_share, clock=split_clock)
        self.backward_threads = backward_threads  # replica threads: the run plan's choice

    # -- topology ---------------------------------------------------------------------------
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0  # among the processes of this machine

    @property
    def is_main(self) -> bool:
        """True in the one process that prints, writes metrics and writes checkpoints."""
        return self.rank == 0

    @property
    def device(self) -> torch.device:
        """Where the loop puts inputs, targets and the model before :meth:`setup`."""
        return self.devices[0]

    # -- lifetime: construction has no side effects; ``with strategy:`` launches, then closes
    def launch(self) -> "Strategy":
        """Join what the strategy runs on (a process group); :meth:`close` leaves it."""
        return self

    def close(self) -> None:
        """Release process groups or other resources."""

    def __enter__(self) -> "Strategy":
        return self.launch()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- model ------------------------------------------------------------------------------
    def setup(self, model: nn.Module) -> nn.Module:
        """Move/wrap ``model`` for training; return what the loop calls. Default: move it."""
        return model.to(self.device)

    def unwrap(self, wrapped: nn.Module) -> nn.Module:
        """The plain model inside what :meth:`setup` returned."""
        return model_state.unwrap(wrapped)

    def state_dict(self, wrapped: nn.Module) -> dict:
        """The plain model's state (what checkpoints hold): no wrapper prefix, buffers in,
        split layers merged."""
        return model_state.plain_state_dict(wrapped)

    def load_state_dict(self, wrapped: nn.Module, state: dict) -> None:
        """Load a plain state dict (from :meth:`state_dict` of any strategy) into what
        :meth:`setup` returned; a state that does not fit is a ``ValueError`` saying how."""
        model_state.load_plain_state_dict(wrapped, state)

    def optimizer_state_dict(self, wrapped: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """``optimizer``'s state as an optimizer of the plain model holds it (what checkpoints
        hold)."""
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, wrapped: nn.Module, optimizer: torch.optim.Optimizer,
                                  state: dict) -> None:
        """Load a plain model's optimizer state (:meth:`optimizer_state_dict` of any
        strategy) into ``optimizer``; one that does not fit is a ``ValueError``."""
        optimizer.load_state_dict(state)

    def plain_norms(self, wrapped: nn.Module) -> PlainNorms:
        """The norms of the optimizer's parameters as the plain model has them
        (:mod:`tandem.plain_norms`; default: each parameter whole), for clipping, LARS, LAMB."""
        return PlainNorms(wrapped.parameters(), device=self.device)

    def forward_loss(self, wrapped: nn.Module, criterion: Callable, images: torch.Tensor,
                     targets: torch.Tensor, batch_size: int | None = None) -> StepOutput:
        """Run the model and the criterion on this process's share of the batch;
        ``batch_size``: the whole global batch's (None: a strategy that needs it asks)."""
        outputs = self._logits(wrapped(images))
        loss = criterion(outputs, targets)
        return StepOutput(loss, *self._score(criterion, outputs, targets, targets.shape[0]))

    def _logits(self, output) -> torch.Tensor:
        return pick_output(output, self.output_key)

    @staticmethod
    def _score(criterion: Callable, outputs: torch.Tensor, targets: torch.Tensor,
              count: int) -> tuple:
        """``(correct, count, correct5, confusion, ce_sum)`` of one chunk, as
        :class:`StepOutput` orders them; dense outputs skip the criterion's ``ignore_index``."""
        ignore = getattr(criterion, "ignore_index", DEFAULT_IGNORE_INDEX)
        correct, correct5, confusion = hits(outputs, targets, ignore)
        return correct, count, correct5, confusion, plain_ce_sum(criterion, outputs, targets)

    # -- collectives (no-ops in one process) ------------------------------------------------
    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over processes and return it. Identity in one process."""
        return tensor

    def barrier(self) -> None:
        """Wait for every process. No-op in one process."""

    @property
    def stops_when(self) -> str:
        """When a signal stops the run, as its line says (ranks read their vote a step late)."""
        return "after the next step (when every rank has heard)" if self.agreement.several \
            else "after this step"

    def no_sync(self, wrapped: nn.Module):
        """Context that skips gradient synchronisation (for accumulation steps)."""
        return contextlib.nullcontext()


_REGISTRY: dict[str, type[Strategy]] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator: make ``cls`` selectable by ``cls.name``."""
    if not cls.name or cls.name in _REGISTRY:
        raise UsageError(f"strategy name {cls.name!r} is empty or already registered")
    _REGISTRY[cls.name] = cls
    return cls


def strategy_names(**abilities) -> list[str]:
    """Registered names in registration order; ``abilities`` keeps those whose class
    attributes have the given values (``strategy_names(multiprocess=True)``)."""
    return [name for name, cls in _REGISTRY.items()
            if all(getattr(cls, k) == v for k, v in abilities.items())]


def strategy_class(name: str) -> type[Strategy]:
    """The class registered as ``name``; an unknown name is an error listing them."""
    if name not in _REGISTRY:
        names = strategy_names()
        raise UsageError(f"unknown strategy {name!r}{did_you_mean(str(name), names)}",
                         hint=f"choose one of {', '.join(names)}")
    return _REGISTRY[name]


def create_strategy(name: str, devices: list[torch.device], **kwargs) -> Strategy:
    """Build the strategy called ``name`` on ``devices``."""
    return strategy_class(name)(devices, **kwargs)
