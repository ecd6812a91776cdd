"""``hybrid-ddp``: the hybrid across processes, one per device (``tandem launch``, torchrun).

See :class:`tandem.hybrid.across_processes.DistributedHybrid`: the trunk data parallel under
DDP, the head's Linear layers split over the ranks, activations on a process group of their
own; the rest is ddp's. Checkpoints hold the plain layout; gathering it is a collective, so
every rank must call :meth:`state_dict` and :meth:`optimizer_state_dict`.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from tandem import model_state
from tandem.errors import first_line
from tandem.hybrid.across_processes import DistributedHybrid
from tandem.parallel.shares import shares

from .base import StepOutput, register
from .ddp import DDPStrategy
from .hybrid import SplitsHead


@register
class HybridDDPStrategy(SplitsHead, DDPStrategy):
    """One torchrun worker per device; the model's head split over the workers."""

    name = "hybrid-ddp"
    splits_batch = False  # even shares (--split would need its timing across the split head)
    compile_unsupported = "its trunk and head blocks would each need compiling"
    across_processes_of = "hybrid"  # `--strategy hybrid` under tandem launch runs this
    state_needs_every_rank = True  # each rank holds a block of the head
    activations = None  # the activations' process group, joined by launch()

    def launch(self) -> "HybridDDPStrategy":
        """Join the job's group (ddp's), then the activations' group (every rank meets)."""
        super().launch()
        if self.activations is None:
            self.activations = self.new_group()
        return self

    def close(self) -> None:
        """Free the DDP reducer, then leave the activations' group, then ddp's (the order
        :func:`~tandem.distributed.process_group.release_ddp` asks)."""
        self.release()
        if self.activations is not None and dist.is_initialized():
            dist.destroy_process_group(self.activations)
        self.activations = None
        super().close()

    # -- model ------------------------------------------------------------------------------
    def setup(self, model: nn.Module) -> nn.Module:
        """:meth:`prepare` ``model`` as ddp does, then split its head (the trunk's gradients
        compressed where ``compression`` says)."""
        wrapped = DistributedHybrid(self.prepare(model), self._device, group=self.activations,
                                    head=self.options["hybrid_head"],
                                    ddp_options=self.ddp_options(),
                                    compressor=self.compressor_for(scale=self.world_size))
        self._wrappers.append(weakref.ref(wrapped.dp))
        return wrapped

    def no_sync(self, wrapped: nn.Module):
        return wrapped.no_sync()

    def forward_loss(self, wrapped: nn.Module, criterion: Callable, images: torch.Tensor,
                     targets: torch.Tensor, batch_size: int | None = None) -> StepOutput:
        """Forward this rank's share (collectives on every rank, in eval too). The loss it
        backpropagates is its rows' part of the global mean: no average over ranks follows."""
        # every rank's rows, as the loader cut them (even shares), so no collective asks
        rows = None if batch_size is None else shares(batch_size, [1] * self.world_size)
        return self.share_loss(wrapped, criterion, images, targets, (rows,), 1)

    # -- state (collectives) ----------------------------------------------------------------
    def state_dict(self, wrapped: nn.Module) -> dict:
        return wrapped.plain_state_dict()

    def load_state_dict(self, wrapped: nn.Module, state: dict) -> None:
        """Checked against the plain shapes without gathering anything, then this rank's
        blocks taken."""
        report = model_state.fit_report(state, wrapped.plain_shapes())
        if report:
            raise ValueError(report)
        try:
            wrapped.load_plain_state_dict(state)
        except Exception as exc:  # dtype trouble and the like, after the key check
            raise ValueError(first_line(exc)) from None

    def plain_norms(self, wrapped: nn.Module):
        """A split layer's blocks summed over the ranks (one all-reduce per call, on
        every rank); the replicated trunk counted once."""
        return wrapped.plain_norms(self.all_reduce_sum)
