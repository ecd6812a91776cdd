"""``ddp``: one process per device, gradients averaged by torch's DistributedDataParallel.

Launch with ``tandem launch`` or ``torchrun``. Losses are scaled so DDP's average is exact for
uneven or empty shares (:mod:`tandem.parallel.loss_terms`); an empty share still runs forward
and backward, BatchNorm in eval mode, so collectives meet. ``--buffers replica0`` broadcasts rank
0's BN stats every forward; ``average`` replaces them by the sample-weighted mean over ranks.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from typing import Callable

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel

from tandem.distributed import faults
from tandem.distributed.env import read_env
from tandem.distributed.global_loss import global_mean, local_sum
from tandem.errors import param
from tandem.distributed.process_group import (
    all_reduce_sum,
    any_rank,
    barrier,
    destroy_process_group,
    grads_in_param_strides,
    init_process_group,
    pick_device,
    release_ddp,
    step_done,
    work_group,
)
from tandem.distributed.rank_batchnorm import average_running_stats, frozen_batchnorm
from tandem.parallel.buffers import check_policy
from tandem.parallel.split import BatchSplit
from tandem.parallel.work_clock import Span
from tandem.parallel.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm

from .base import StepOutput, Strategy, register

__all__ = ["DDPStrategy"]

_HAS_FORWARD_SYNC = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
# BatchNorm classes that synchronise across processes: safe in training on 0 local samples.
_SYNC_BN = (SyncBatchNorm, nn.SyncBatchNorm)


def _plain_batchnorms(model: nn.Module) -> list:
    return [m for m in model.modules() if isinstance(m, _BatchNorm) and not isinstance(m, _SYNC_BN)]


@register
class DDPStrategy(Strategy):
    """One torchrun worker per device. Creating it only reads torchrun's environment;
    :meth:`launch` joins the process group and :meth:`close` leaves it.

    ``timeout`` (seconds) defaults to ``TANDEM_DIST_TIMEOUT``.
    """

    name = "ddp"
    multiprocess = True
    max_devices = 1
    splits_batch = True

    def __init__(self, devices: list[torch.device], *, sync_bn: bool = False,
                 buffers: str = "replica0", timeout: float | None = None, split=None,
                 max_share: int | None = None, **kwargs):
        super().__init__(devices, sync_bn=sync_bn, buffers=buffers, **kwargs)
        check_policy(buffers)
        self.env = read_env(who=f"{param('strategy')} {self.name}")
        self.rank = self.env.rank
        self.world_size = self.env.world_size
        self._device = pick_device(self.env, self.devices)
        # This process touches only its own device (memory stats, syncs): never the others'.
        self.devices = [self._device]
        self.timeout = timeout
        self.backend: str | None = None  # set by launch()
        self._plain_bn: list = []  # BatchNorms that do not sync: see rank_batchnorm
        self._wrappers: list[weakref.ref] = []  # released by close(), see release_ddp
        self._hooks: list = []  # grads_in_param_strides', --split auto's; removed by close()
        self._stop_calls = 0  # see stop_vote
        # --split: each rank loads its share of every global batch, the same on every rank
        self.split = BatchSplit(split, self.world_size, max_share, by_loader=True,
                                reduce=lambda t: all_reduce_sum(t, self._device),
                                clock=self.split.clock)
        self.split.check_weights("split")

    @property
    def device(self) -> torch.device:
        return self._device

    def launch(self) -> "DDPStrategy":
        """Join the process group (every rank meets here; see init_process_group)."""
        if self.backend is None:
            self.backend = init_process_group(self.env, self._device, self.timeout)
        return self

    # -- model ------------------------------------------------------------------------------
    def setup(self, model: nn.Module) -> nn.Module:
        """Move ``model`` to this rank's device, convert BN if ``sync_bn``, wrap it in DDP.

        Its gradients reach DDP in their parameters' strides (:func:`grads_in_param_strides`).
        """
        if self.sync_bn:
            model = convert_sync_batchnorm(model, process_group=work_group())
        model = model.to(self._device)
        self._plain_bn = _plain_batchnorms(model)
        # Gradients in their parameters' strides, as DDP's buckets have them (digits' conv1).
        self._hooks += grads_in_param_strides(model)
        self._hooks += self.split.time_backward_end(self.rank, model)
        wrapped = DistributedDataParallel(model, **self.ddp_options())
        self._wrappers.append(weakref.ref(wrapped))
        return wrapped

    def ddp_options(self) -> dict:
        """The keywords this strategy gives ``DistributedDataParallel`` besides the module:
        its device, the work group, and whether rank 0's buffers are broadcast at every
        forward (under ``--buffers replica0`` only; newer torch renamed the flag, and buffers
        are synced at construction either way)."""
        device_ids = [self._device] if self._device.type == "cuda" else None
        flag = "forward_sync_buffers" if _HAS_FORWARD_SYNC else "broadcast_buffers"
        return {"device_ids": device_ids, "process_group": work_group(),
                flag: self.buffers == "replica0"}

    def forward_loss(self, wrapped: nn.Module, criterion: Callable, images: torch.Tensor,
                     targets: torch.Tensor) -> StepOutput:
        """Forward this rank's share; one small all-reduce per call on every rank, in eval too,
        and no read of the device."""
        training = torch.is_grad_enabled() and wrapped.training
        timed = training and self.split.auto is not None
        span = Span(self._device) if timed else None  # --split auto times this rank's own work
        images = images.to(self._device, non_blocking=True)
        targets = targets.to(self._device, non_blocking=True)
        count = int(targets.shape[0])
        frozen = self._plain_bn if (count == 0 and wrapped.training) else []
        with frozen_batchnorm(frozen):
            outputs = self._logits(wrapped(images))
        summed, denominator = local_sum(criterion, outputs, targets)
        if timed:  # before the all-reduce waits
            self.split.record(self.rank, count, span.stop())
            self.split.time_backward_start(summed)
        # the step makes no host sync: the loop reads the sums when it prints
        loss, total_count = global_mean(criterion, summed, denominator, count,
                                        self.world_size, self._device)
        if training and self.buffers == "average":
            average_running_stats(self._plain_bn, count, total_count, self._device)
        return StepOutput(loss, *self._score(criterion, outputs, targets, count))

    # -- collectives ------------------------------------------------------------------------
    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks; returns a new tensor on ``tensor``'s device (input untouched)."""
        return all_reduce_sum(tensor, self._device)

    def barrier(self) -> None:
        barrier()

    def any_process(self, flag: bool) -> bool:
        return any_rank(flag, self._device)

    #: optimizer steps between two stop votes: a vote reads one number back from the device
    STOP_VOTE_EVERY = 8
    stops_when = f"at the processes' next vote (within {STOP_VOTE_EVERY} steps)"

    def stop_vote(self, flag: bool) -> bool:
        """Vote every :attr:`STOP_VOTE_EVERY` calls only (every rank calls it once a step, so
        the ranks count alike and stop at the same step); a signal waits for the next vote."""
        self._stop_calls += 1
        return self._stop_calls % self.STOP_VOTE_EVERY == 0 and self.any_process(flag)

    def step_done(self, step: int) -> None:
        step_done(step)

    def lost_peer(self, exc: BaseException, where: str):
        """See :func:`tandem.distributed.faults.lost_peer`; one line per node (local rank 0)."""
        lost = faults.lost_peer(exc, self.rank, where)
        if lost is not None:
            lost.quiet = self.env.local_rank != 0
        return lost

    def no_sync(self, wrapped: nn.Module):
        """DDP's ``no_sync``: gradients accumulate locally until a step outside it."""
        return wrapped.no_sync() if isinstance(wrapped, DistributedDataParallel) else (
            contextlib.nullcontext())

    def close(self) -> None:
        """Free the DDP wrappers' reducers, then leave the process group (see release_ddp)."""
        for ref in self._wrappers:
            release_ddp(ref())
        self._wrappers.clear()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        if self.backend is not None:
            destroy_process_group()
            self.backend = None
