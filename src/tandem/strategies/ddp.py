"""``ddp``: one process per device, gradients averaged by torch's DistributedDataParallel.

Launch with ``tandem launch`` or ``torchrun``. Losses are scaled so DDP's average is exact for
uneven or empty shares (:mod:`tandem.parallel.loss_terms`); an empty share still runs forward
and backward, BatchNorm in eval mode, so collectives meet. ``--buffers replica0`` broadcasts rank
0's BN stats every forward; ``average`` replaces them by the sample-weighted mean over ranks.
"""

from __future__ import annotations

import contextlib
import inspect
import time
import weakref
from typing import Callable

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel

from tandem.distributed.env import read_env
from tandem.distributed.global_loss import local_sum, reduction_of
from tandem.distributed.process_group import (
    all_reduce_sum,
    destroy_process_group,
    grads_in_param_strides,
    init_process_group,
    pick_device,
    release_ddp,
    work_group,
)
from tandem.parallel.buffers import check_policy
from tandem.parallel.split import BatchSplit
from tandem.parallel.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm

from .base import StepOutput, Strategy, register

__all__ = ["DDPStrategy"]

_HAS_FORWARD_SYNC = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters


# BatchNorm classes that synchronise across processes: safe in training on 0 local samples.
_SYNC_BN = (SyncBatchNorm, nn.SyncBatchNorm)


def _plain_batchnorms(model: nn.Module) -> list[_BatchNorm]:
    return [m for m in model.modules() if isinstance(m, _BatchNorm) and not isinstance(m, _SYNC_BN)]


@contextlib.contextmanager
def _frozen_batchnorm(layers: list[_BatchNorm]):
    """Run ``layers`` in eval mode for one empty-share forward; ``num_batches_tracked`` advances."""
    training = [m.training for m in layers]
    for m in layers:
        m.eval()
    try:
        yield
    finally:
        for m, was in zip(layers, training):
            m.train(was)
            if was and m.num_batches_tracked is not None:
                m.num_batches_tracked.add_(1)


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
        self.env = read_env(who=f"--strategy {self.name}")
        self.rank = self.env.rank
        self.world_size = self.env.world_size
        self._device = pick_device(self.env, self.devices)
        # This process touches only its own device (memory stats, syncs): never the others'.
        self.devices = [self._device]
        self.timeout = timeout
        self.backend: str | None = None  # set by launch()
        self._plain_bn: list[_BatchNorm] = []
        self._wrappers: list[weakref.ref] = []  # released by close(), see release_ddp
        self._grad_hooks: list = []  # see grads_in_param_strides, removed by close()
        self._stop_calls = 0  # see stop_vote
        # --split: each rank loads its share of every global batch, the same on every rank
        self.split = BatchSplit(split, self.world_size, max_share, by_loader=True,
                                reduce=lambda t: all_reduce_sum(t, self._device))
        self.split.check_weights("split")
        # this rank's own work: its forwards up to the loss, and its backwards up to the
        # first parameter's gradient (the last computed), no waiting (see BatchSplit)
        self._backward_start = 0.0

    def _backward_starts(self, grad):
        self._backward_start = time.perf_counter()

    def _backward_done(self, param):
        self.split.record(self.rank, 0, time.perf_counter() - self._backward_start)

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
        self._grad_hooks += grads_in_param_strides(model)
        first = next((p for p in model.parameters() if p.requires_grad), None)
        if self.split.auto is not None and first is not None:  # its gradient comes last
            self._grad_hooks.append(first.register_post_accumulate_grad_hook(self._backward_done))
        device_ids = [self._device] if self._device.type == "cuda" else None
        # Rank 0's buffers are broadcast at every forward under "replica0" only; newer torch
        # renamed the flag (buffers are synced at construction either way).
        sync = self.buffers == "replica0"
        flag = "forward_sync_buffers" if _HAS_FORWARD_SYNC else "broadcast_buffers"
        wrapped = DistributedDataParallel(model, device_ids=device_ids,
                                          process_group=work_group(), **{flag: sync})
        self._wrappers.append(weakref.ref(wrapped))
        return wrapped

    def forward_loss(self, wrapped: nn.Module, criterion: Callable, images: torch.Tensor,
                     targets: torch.Tensor) -> StepOutput:
        """Forward this rank's share; one small all-reduce per call on every rank, in eval too,
        and no read of the device."""
        training = torch.is_grad_enabled() and wrapped.training
        start = time.perf_counter()  # --split auto times this rank's own work
        images = images.to(self._device, non_blocking=True)
        targets = targets.to(self._device, non_blocking=True)
        count = int(targets.shape[0])
        frozen = self._plain_bn if (count == 0 and wrapped.training) else []
        with _frozen_batchnorm(frozen):
            outputs = self.logits(wrapped(images))
        summed, denominator = local_sum(criterion, outputs, targets)
        # One all-reduce of (S_r, D_r, n_r); its results stay on the device, read by nobody
        # here: the step makes no host sync (the loop reads its sums when it prints).
        stats = torch.stack([summed.detach().double(), denominator.double(),
                             torch.full((), float(count), dtype=torch.float64,
                                        device=summed.device)])
        if training and self.split.auto is not None:  # before the all-reduce waits
            self.split.record(self.rank, count, time.perf_counter() - start)
            if summed.requires_grad:
                summed.register_hook(self._backward_starts)
        total_sum, total_den, total_count = all_reduce_sum(stats, self._device).unbind()
        if reduction_of(criterion) == "sum":  # the global loss is the plain sum of S_r
            total_den = torch.ones_like(total_den)
        if training and self.buffers == "average":
            self._average_buffers(count, total_count)
        mean = (total_sum / total_den).to(summed.dtype)  # 0/0: nan, as no samples anywhere
        if summed.requires_grad:
            # The value is the global mean; the gradient is that of S_r * world / D, which
            # DDP's average over ranks turns into the gradient of the global mean.
            scale = torch.where(total_den != 0, self.world_size / total_den,
                                torch.ones_like(total_den))
            scaled = summed * scale.to(summed.dtype)
            loss = scaled + (mean - scaled).detach()
        else:
            loss = mean
        return StepOutput(loss, *self.score(criterion, outputs, targets, count))

    def _average_buffers(self, count: int, total_count: torch.Tensor) -> None:
        """Replace BN running stats by their sample-weighted mean over ranks (kept as they
        are when no rank had a sample); ``total_count`` stays on the device.

        New tensors are assigned, not written in place: autograd saved the old ones for backward.
        """
        layers = [m for m in self._plain_bn if m.track_running_stats and m.running_mean is not None]
        if not layers:
            return
        flat = torch.cat([torch.cat([m.running_mean, m.running_var]) for m in layers])
        total = total_count.to(flat.dtype)
        summed = all_reduce_sum(flat * count, self._device)
        flat = torch.where(total > 0, summed / total.clamp(min=1), flat)
        offset = 0
        for m in layers:
            n = m.running_mean.numel()
            m.running_mean = flat[offset:offset + n].clone()
            m.running_var = flat[offset + n:offset + 2 * n].clone()
            offset += 2 * n

    # -- collectives ------------------------------------------------------------------------
    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks; returns a new tensor on ``tensor``'s device (input untouched)."""
        return all_reduce_sum(tensor, self._device)

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=work_group())

    def any_process(self, flag: bool) -> bool:
        votes = torch.tensor([1.0 if flag else 0.0], dtype=torch.float64)
        return bool(self.all_reduce_sum(votes).item() > 0)

    #: optimizer steps between two stop votes: a vote reads one number back from the device
    STOP_VOTE_EVERY = 8
    stops_when = f"at the processes' next vote (within {STOP_VOTE_EVERY} steps)"

    def stop_vote(self, flag: bool) -> bool:
        """Vote every :attr:`STOP_VOTE_EVERY` calls only (every rank calls it once a step, so
        the ranks count alike and stop at the same step); a signal waits for the next vote."""
        self._stop_calls += 1
        return self._stop_calls % self.STOP_VOTE_EVERY == 0 and self.any_process(flag)

    @classmethod
    def resume_command_for(cls, target: str, processes: int = 1, nodes: int = 1) -> str:
        where = "" if nodes <= 1 else f" --nnodes {nodes} (on every node)"
        return (f"tandem launch --nproc-per-node {processes // max(1, nodes)}{where} -- "
                f"train --resume {target}")

    def resume_command(self, run_dir: str) -> str:
        nodes = self.world_size // max(1, self.env.local_world_size)
        return self.resume_command_for(run_dir, self.world_size, nodes)

    def no_sync(self, wrapped: nn.Module):
        """DDP's ``no_sync``: gradients accumulate locally until a step outside it."""
        return wrapped.no_sync() if isinstance(wrapped, DistributedDataParallel) else (
            contextlib.nullcontext())

    def close(self) -> None:
        """Free the DDP wrappers' reducers, then leave the process group (see release_ddp)."""
        for ref in self._wrappers:
            release_ddp(ref())
        self._wrappers.clear()
        for handle in self._grad_hooks:
            handle.remove()
        self._grad_hooks.clear()
        if self.backend is not None:
            destroy_process_group()
            self.backend = None
