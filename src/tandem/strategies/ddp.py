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
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel

from tandem.distributed import faults
from tandem.distributed.agree import Agreement
from tandem.distributed.compression import NONE, Compression, Compressor
from tandem.distributed.env import LAUNCH_HINT, DistEnv
from tandem.distributed.global_loss import global_mean, local_sum
from tandem.errors import UsageError, param
from tandem.distributed.process_group import (
    all_reduce_sum, backend_for, barrier, destroy_process_group, grads_in_param_strides,
    init_process_group, pick_device, release_ddp)
from tandem.distributed.rank_batchnorm import average_running_stats, frozen_batchnorm
from tandem.parallel.buffers import check_policy
from tandem.parallel.split import BatchSplit
from tandem.parallel.work_clock import Span
from tandem.parallel.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm

from .base import StepOutput, Strategy, register


# newer torch renamed broadcast_buffers
_HAS_FORWARD_SYNC = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
_SYNC_BN = (SyncBatchNorm, nn.SyncBatchNorm)  # sync across ranks: safe on 0 local samples


@register
class DDPStrategy(Strategy):
    """One torchrun worker per device, placed by ``env`` (torchrun's variables as the plan read
    them; default the agreement's); :meth:`launch` joins the process group (``timeout``
    seconds, default ``env.timeout``) and :meth:`close` leaves it."""

    name = "ddp"
    multiprocess = True
    max_devices = 1
    splits_batch = True
    compresses_gradients = True

    def __init__(self, devices: list[torch.device], *, sync_bn: bool = False,
                 buffers: str = "replica0", timeout: float | None = None, split=None,
                 max_share: int | None = None, env: DistEnv | None = None,
                 compression: Compression = NONE, **kwargs):
        super().__init__(devices, sync_bn=sync_bn, buffers=buffers, **kwargs)
        check_policy(buffers)
        self.env = env if env is not None else self.agreement.env
        if self.env is None:
            raise UsageError(f"{param('strategy')} {self.name} needs torchrun's environment",
                             hint=LAUNCH_HINT)
        self.rank, self.world_size = self.env.rank, self.env.world_size
        self._device = pick_device(self.env, self.devices)
        self.devices = [self._device]  # it touches only its own device (memory stats, syncs)
        self.timeout = timeout
        self.compression = compression  # --grad-compression: set up with the model
        self.backend: str | None = None  # set by launch()
        self._plain_bn: list = []  # BatchNorms that do not sync: see rank_batchnorm
        self._wrappers: list[weakref.ref] = []  # released by close(), see release_ddp
        self._hooks: list = []  # grads_in_param_strides', --split auto's; removed by close()
        self._joined = False  # launch() made the group (outside a Job): close() leaves it
        if not self.agreement.several:  # launched outside a Job: its own, on the same group
            self.agreement = Agreement(self.rank, self.world_size, node=self.env.node,
                                       addr=self.env.addr, env=self.env)
        # --split: each rank loads its share of every global batch, the same on every rank
        self.split = BatchSplit(split, self.world_size, max_share, by_loader=True,
                                reduce=lambda t: all_reduce_sum(t, self._device),
                                clock=self.split.clock)
        self.split.check_weights("split")

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def local_rank(self) -> int:
        return self.env.local_rank

    @property
    def failure_model(self) -> str:
        """gloo's survivors get an error; NCCL's watchdog aborts them."""
        return faults.RAISES if backend_for(self._device) == "gloo" else faults.ABORTS

    def launch(self) -> "DDPStrategy":
        """Join the process group, or the job's (every rank meets here; see init_process_group)."""
        if self.backend is None:
            self._joined = not dist.is_initialized()
            self.backend = init_process_group(self.env, self._device, self.timeout)
        if self.compression.mode == "powersgd" and self.gradients is None:
            # PowerSGD issues collectives from callbacks while backward issues others
            # (SyncBatchNorm's, the split head's): on a group of their own, the ranks' orders agree
            self.gradients = self.new_group()
        return self

    gradients = None  # --grad-compression powersgd's process group, joined by launch()

    def new_group(self):
        """A new process group of this strategy's own (every rank meets), its collectives
        waiting ``timeout`` seconds (default ``env.timeout``)."""
        seconds = self.env.timeout if self.timeout is None else float(self.timeout)
        return dist.new_group(backend=self.backend, timeout=timedelta(seconds=seconds))

    def compressor_for(self, scale: float = 1.0) -> Compressor | None:
        """The hook state of ``compression`` (``None``: exact), ``scale`` times DDP's mean."""
        if self.compression.exact:
            return None
        self.compressor = Compressor(self.compression, self.gradients, scale)
        return self.compressor

    # -- model ------------------------------------------------------------------------------
    def setup(self, model: nn.Module) -> nn.Module:
        """:meth:`prepare` ``model``, then wrap it in DDP (its gradients compressed where
        ``compression`` says)."""
        wrapped = DistributedDataParallel(self.prepare(model), **self.ddp_options())
        self._wrappers.append(weakref.ref(wrapped))
        if self.compressor_for() is not None:
            self.compressor.register(wrapped)
        return wrapped

    def prepare(self, model: nn.Module) -> nn.Module:
        """Convert BN if ``sync_bn`` and move ``model`` to this rank's device, its gradients in
        their parameters' strides (as DDP's buckets have them)."""
        if self.sync_bn:
            model = convert_sync_batchnorm(model)
        model = model.to(self._device)
        self._plain_bn = [m for m in model.modules()
                          if isinstance(m, _BatchNorm) and not isinstance(m, _SYNC_BN)]
        self._hooks += grads_in_param_strides(model)
        self._hooks += self.split.time_backward_end(self.rank, model)
        return model

    def ddp_options(self) -> dict:
        """``DistributedDataParallel``'s keywords besides the module: the device, and rank 0's
        buffers broadcast at every forward under ``--buffers replica0`` only."""
        device_ids = [self._device] if self._device.type == "cuda" else None
        flag = "forward_sync_buffers" if _HAS_FORWARD_SYNC else "broadcast_buffers"
        return {"device_ids": device_ids, flag: self.buffers == "replica0"}

    def forward_loss(self, wrapped: nn.Module, criterion: Callable, images: torch.Tensor,
                     targets: torch.Tensor, batch_size: int | None = None) -> StepOutput:
        """Forward this rank's share; one small all-reduce per call on every rank, in eval too,
        and no read of the device."""
        return self.share_loss(wrapped, criterion, images, targets, (), self.world_size)

    def share_loss(self, wrapped: nn.Module, criterion: Callable, images: torch.Tensor,
                   targets: torch.Tensor, args: tuple, world: int) -> StepOutput:
        """:meth:`forward_loss` with ``wrapped(images, *args)``; ``world``: what the global
        mean's gradient is multiplied by (DDP then averages over the ranks)."""
        training = torch.is_grad_enabled() and wrapped.training
        timed = training and self.split.auto is not None
        span = Span(self._device) if timed else None  # --split auto times this rank's own work
        images = images.to(self._device, non_blocking=True)
        targets = targets.to(self._device, non_blocking=True)
        count = int(targets.shape[0])
        frozen = self._plain_bn if (count == 0 and wrapped.training) else []
        with frozen_batchnorm(frozen):
            outputs = self._logits(wrapped(images, *args))
        summed, denominator = local_sum(criterion, outputs, targets)
        if timed:  # before the all-reduce waits
            self.split.record(self.rank, count, span.stop())
            self.split.time_backward_start(summed)
        # the step makes no host sync: the loop reads the sums when it prints
        loss, total_count = global_mean(criterion, summed, denominator, count, world, self._device)
        if training and self.buffers == "average":
            average_running_stats(self._plain_bn, count, total_count, self._device)
        return StepOutput(loss, *self._score(criterion, outputs, targets, count))

    # -- collectives ------------------------------------------------------------------------
    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks; returns a new tensor on ``tensor``'s device (input untouched)."""
        return all_reduce_sum(tensor, self._device)

    def barrier(self) -> None:
        barrier()

    def no_sync(self, wrapped: nn.Module):
        """DDP's ``no_sync``: gradients accumulate locally until a step outside it."""
        return wrapped.no_sync() if isinstance(wrapped, DistributedDataParallel) else (
            contextlib.nullcontext())

    def close(self) -> None:
        """Free the DDP wrappers' reducers, then leave the group if :meth:`launch` made it."""
        self.release()
        if self.gradients is not None and dist.is_initialized():
            dist.destroy_process_group(self.gradients)
        self.gradients = None
        if self.backend is not None and self._joined:
            destroy_process_group()
        self.backend, self._joined = None, False

    def release(self) -> None:
        """Free the DDP wrappers' reducers and remove the hooks (safe twice)."""
        for ref in self._wrappers:
            release_ddp(ref())
        self._wrappers.clear()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
