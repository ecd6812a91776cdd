"""Batch normalization with statistics over the whole global batch.

Unlike ``torch.nn.SyncBatchNorm`` it merges over replica threads (any device, CPU too) as well
as processes, with uneven or empty local batches. Cost: one rendezvous per layer per forward.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from tandem.errors import UsageError

from . import context
from .sync_functions import GlobalMoments, LocalMoments, Normalize, ReplicaMoments, SharedMoments


# replicas are copies and keep this number: "the same layer" at the rendezvous
_TAGS = itertools.count()


@dataclass
class _Part:
    """What one replica brings to the rendezvous."""

    moments: torch.Tensor  # (3, C): count, mean, m2
    count: int  # values per channel in this replica's batch
    device: torch.device
    buffers: tuple  # data pointers of this replica's running stats (None without them)


class SyncBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics span every replica thread and process
    (``process_group``; ``None``: the default one), equal to ``nn.BatchNorm`` on the global batch.

    Warnings: across processes on an accelerator, one value per channel normalizes with variance
    0 instead of raising; double backward through a synchronized forward raises.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, process_group=None,
                 device=None, dtype=None, *, bias: bool = True):
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype)
        if affine and not bias:  # done by hand: older torch's _BatchNorm has no ``bias``
            self.register_parameter("bias", None)
        self.process_group = process_group
        self._sync_tag = next(_TAGS)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise UsageError(f"SyncBatchNorm expects an (N, C, ...) input, got {input.dim()}D")
        if input.size(1) != self.num_features:
            raise UsageError(
                f"SyncBatchNorm({self.num_features}) got an input with {input.size(1)} channels")

    def _process_group(self):  # None: nothing to merge with
        if not (dist.is_available() and dist.is_initialized()):
            return None
        group = dist.group.WORLD if self.process_group is None else self.process_group
        return group if dist.get_world_size(group) > 1 else None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        replica = context.current() if self.training else None
        threads = replica is not None and replica.num_replicas > 1
        group = self._process_group() if self.training else None
        if not threads and group is None:
            return super().forward(input)  # plain BatchNorm, bit for bit
        moments = LocalMoments.apply(input)  # (3, C): count, mean, m2 of this replica
        if threads:
            count = input.numel() // input.size(1) if input.size(1) else 0
            part = _Part(moments, count, input.device, self._buffer_ids())
            key = replica.next_key(("SyncBatchNorm", self._sync_tag))
            separate = replica.group.separate_backward
            total, owner = replica.group.combine(
                key, replica.index, part, lambda parts: _meet(parts, group, separate))
            if separate:  # each replica's own node, meeting in backward
                anchor = _anchor(input) if group is not None else None
                total = ReplicaMoments.apply(total, replica.group, replica.index, key, anchor,
                                             moments)
        else:
            (total,) = GlobalMoments.apply(group, [input.device], _anchor(input), moments)
            owner = True
        if group is not None and total.device.type == "cpu":  # free here; all ranks see one n
            _check_count(int(total[0, 0]), f"{dist.get_world_size(group)} processes")
        # total: (4, C) global count, mean, biased and unbiased variance, on input.device
        if owner:
            self._update_running_stats(total[1], total[3])
        return Normalize.apply(input, total, self.weight, self.bias, self.eps)

    def _buffer_ids(self) -> tuple:
        return tuple(None if b is None else (b.device, b.data_ptr())
                     for b in (self.running_mean, self.running_var, self.num_batches_tracked))

    @torch.no_grad()
    def _update_running_stats(self, mean, unbiased_var) -> None:
        """Fold the global mean and unbiased variance into the running stats."""
        if not self.track_running_stats or self.running_mean is None:
            return
        if self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        # momentum None: a cumulative moving average
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        self.running_mean.lerp_(mean.to(self.running_mean.dtype), factor)
        self.running_var.lerp_(unbiased_var.to(self.running_var.dtype), factor)


def _check_count(count: int, where: str) -> None:
    if count <= 1:
        # ValueError with BatchNorm's own words: code that handles BatchNorm's error handles ours
        raise ValueError("Expected more than 1 value per channel when training, got "
                         f"{count} across {where}")


def _anchor(x: torch.Tensor):
    """A grad-requiring scalar: a process whose input needs no gradient (an empty batch) still
    reaches the backward all-reduce the others wait in."""
    return torch.zeros((), device=x.device, requires_grad=True) if torch.is_grad_enabled() else None


def _meet(parts: list[_Part], group, separate: bool) -> list[tuple]:
    """By the last replica to arrive: ``(moments, owner)`` per replica from one GlobalMoments
    node, or with ``separate`` ``(SharedMoments, owner)``; ``owner`` is False where a replica's
    running stats share storage with an earlier replica's (updated once)."""
    channels = {p.moments.shape[-1] for p in parts}
    if len(channels) != 1:
        raise UsageError(f"SyncBatchNorm replicas disagree on channels: {sorted(channels)}")
    if group is None:
        _check_count(sum(p.count for p in parts), f"{len(parts)} replicas")
    owners = [p.buffers not in {q.buffers for q in parts[:i]} for i, p in enumerate(parts)]
    if separate:
        with torch.no_grad():
            shared = SharedMoments(group, [p.moments.detach() for p in parts])
        return [(shared, owner) for owner in owners]
    anchor = _anchor(parts[0].moments) if group is not None else None
    totals = GlobalMoments.apply(group, [p.device for p in parts], anchor,
                                 *[p.moments for p in parts])
    return list(zip(totals, owners))


def convert_sync_batchnorm(module: nn.Module, process_group=None) -> nn.Module:
    """Replace every ``_BatchNorm`` in ``module`` (the root too) with :class:`SyncBatchNorm`,
    reusing its tensors (an optimizer built on them stays valid) and ``training`` flag.

    Warning: hooks on the old layers are lost. A new object only when the root is a batch norm.
    """
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        if isinstance(module.weight, nn.parameter.UninitializedParameter):
            raise UsageError(f"cannot convert {type(module).__name__} before its first forward "
                             "(lazy parameters are uninitialized)")
        new = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_group,
                            device="meta", bias=module.bias is not None or not module.affine)
        for name in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked"):
            setattr(new, name, getattr(module, name))
        new.train(module.training)
        return new
    for name, child in module.named_children():
        converted = convert_sync_batchnorm(child, process_group)
        if converted is not child:
            module.add_module(name, converted)
    return module
