"""The autograd Functions behind SyncBatchNorm: local moments, their global merge, normalization.

Moments are ``[count, mean, m2]`` per channel, merged with Chan et al.'s formula (no cancelling
sums of squares). :class:`GlobalMoments` is ONE node for all replicas (replicas on one device
share an autograd thread: a barrier in backward would deadlock); replicas with their own
backward threads get a :class:`ReplicaMoments` node each, which meet in backward.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable
from torch.nn import functional as F


_HALF = (torch.float16, torch.bfloat16)


def local_moments(x: torch.Tensor) -> torch.Tensor:
    """``[count, mean, m2]`` per channel of ``x`` (``(N, C, *)``), untracked; half precision is
    reduced in float32 and returned in float64; an empty batch gives zeros."""
    acc = torch.float64 if x.dtype in (*_HALF, torch.float64) else torch.float32
    out = torch.zeros(3, x.size(1), dtype=acc, device=x.device)
    count = x.numel() // max(x.size(1), 1)
    if count:
        with torch.no_grad():
            work = x.float() if x.dtype in _HALF else x
            var, mean = torch.var_mean(work, dim=[0, *range(2, x.dim())], correction=0)
            out[0] = count
            out[1] = mean
            torch.mul(var, count, out=out[2])
    return out


def merge_moments(parts: torch.Tensor) -> torch.Tensor:
    """Merge stacked parts ``(P, 3, C)`` into one ``(3, C)``; empty parts weigh nothing."""
    n_p, mean_p, m2_p = parts.unbind(1)
    n = n_p.sum(0)
    mean = (n_p / n.clamp(min=1) * mean_p).sum(0)
    spread = mean_p - mean
    m2 = torch.addcmul(m2_p, n_p * spread, spread).sum(0)  # sum m2_p + n_p * spread^2
    return torch.stack([n, mean, m2])


def _merge_grads(parts: torch.Tensor, merged: torch.Tensor, g_mean, g_m2) -> torch.Tensor:
    """Gradients of ``merge_moments`` w.r.t. each part ``(P, 3, C)``: d mean/d mean_p = n_p/n,
    d m2/d mean_p = 2 n_p (mean_p - mean) (sum n_j (mean_j - mean) = 0), d m2/d m2_p = 1."""
    n_p, mean_p, _ = parts.unbind(1)
    n, mean, _ = merged.unbind(0)
    grad_mean = n_p * (g_mean / n.clamp(min=1) + 2 * g_m2 * (mean_p - mean))
    return torch.stack([torch.zeros_like(grad_mean), grad_mean, g_m2.expand_as(grad_mean)], 1)


class LocalMoments(torch.autograd.Function):
    """``x -> [count, mean, m2]``; backward ``grad_x = (x - mean) * 2 g_m2 + g_mean / n``."""

    @staticmethod
    def forward(ctx, x):
        part = local_moments(x)
        ctx.save_for_backward(x, part)
        return part

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, part = ctx.saved_tensors
        if x.numel() == 0:
            return torch.zeros_like(x)
        work = torch.promote_types(x.dtype, torch.float32)
        shape = (1, -1) + (1,) * (x.dim() - 2)
        n, mean, _ = part.unbind(0)
        slope = (2 * grad[2]).to(work).view(shape)
        offset = (grad[1] / n).to(work).view(shape)
        centered = x.to(work) - mean.to(work).view(shape)
        return torch.addcmul(offset, centered, slope).to(x.dtype)


class SharedMoments:
    """One layer call's global statistics and their backward, for :class:`GlobalMoments` and
    :class:`ReplicaMoments`; ``stats[i]``, ``[count, mean, var, unbiased var]``, on
    ``devices[i]`` (default: the parts'). With a process ``group``, one ``all_gather`` merges
    every process's moments in forward and one ``all_reduce`` adds their gradients in backward."""

    def __init__(self, group, parts: Sequence[torch.Tensor], devices=None):
        self.group, self.devices = group, [p.device for p in parts]
        self.local = torch.stack([p.to(self.devices[0]) for p in parts])  # (P, 3, C)
        self.merged = merge_moments(self.local)  # this process's replicas, (3, C)
        self.total = self.merged
        if group is not None:
            gathered = [torch.empty_like(self.merged) for _ in range(dist.get_world_size(group))]
            dist.all_gather(gathered, self.merged.contiguous(), group=group)
            self.total = merge_moments(torch.stack(gathered))
        n, mean, m2 = self.total.unbind(0)
        stats = torch.stack([n, mean, m2 / n.clamp(min=1), m2 / (n - 1).clamp(min=1)])
        # a copy per output: autograd must not see one tensor returned twice
        self.stats = [stats.to(d, copy=True) for d in (devices or self.devices)]

    def part_grads(self, grads: list) -> list:
        """Each replica's part gradient, on its device, from the replicas' ``stats`` gradients
        summed in replica order (once, in backward)."""
        present = [g.to(self.local.device) for g in grads if g is not None]
        grad = torch.stack(present).sum(0) if present else torch.zeros_like(self.total)
        g_mean, g_m2 = grad[1], grad[2] / self.total[0].clamp(min=1)  # var = m2 / n
        if self.group is not None:
            # every process's loss depends on the global moments: this process's share of the sum
            both = torch.stack([g_mean, g_m2])
            dist.all_reduce(both, group=self.group)
            share = _merge_grads(self.merged.unsqueeze(0), self.total, both[0], both[1])[0]
            g_mean, g_m2 = share[1], share[2]
        found = _merge_grads(self.local, self.merged, g_mean, g_m2)
        return [found[i].to(d) for i, d in enumerate(self.devices)]


class GlobalMoments(torch.autograd.Function):
    """``apply(group, devices, anchor, *parts)``: every replica's ``(3, C)`` part (and with a
    process ``group``, every process's) merged; output ``i``, ``(4, C)`` stats on ``devices[i]``.
    ``anchor``, a grad-requiring scalar, makes every process reach the backward's all-reduce."""

    @staticmethod
    def forward(ctx, group, devices: Sequence[torch.device], anchor, *parts):
        ctx.shared = SharedMoments(group, parts, devices)
        stats, ctx.shared.stats = ctx.shared.stats, None  # ctx holds no output: no cycle
        return tuple(stats)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        found = ctx.shared.part_grads(grads)
        return (None, None, None,
                *(g if ctx.needs_input_grad[3 + i] else None for i, g in enumerate(found)))


class ReplicaMoments(torch.autograd.Function):
    """``apply(shared, group, index, key, anchor, part)``: replica ``index``'s ``(4, C)`` stats;
    its backward meets the others' in ``group`` under ``key`` (``anchor``: as in GlobalMoments)."""

    @staticmethod
    def forward(ctx, shared, group, index, key, anchor, part):
        ctx.shared, ctx.group, ctx.index, ctx.key = shared, group, index, key
        return shared.stats[index].clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        shared, ctx.shared = ctx.shared, None
        if shared is None:
            raise RuntimeError(f"SyncBatchNorm: replica {ctx.index}'s statistics were used by "
                               "a backward already")
        part = ctx.group.combine(("backward", ctx.key), ctx.index, grad, shared.part_grads)
        return None, None, None, None, None, part


class Normalize(torch.autograd.Function):
    """``apply(x, stats, weight, bias, eps)``: ``F.batch_norm`` with *given* stats, differentiable
    in them too: d/d mean = -w invstd sum(g), d/d var = -w invstd^2 sum(g xhat) / 2."""

    @staticmethod
    def forward(ctx, x, stats, weight, bias, eps):
        dtype = weight.dtype if weight is not None else torch.promote_types(x.dtype, torch.float32)
        mean, var = stats[1].detach().to(dtype), stats[2].detach().to(dtype)
        ctx.eps, ctx.stats_dtype = eps, stats.dtype
        ctx.save_for_backward(x, mean, var, weight, bias)
        return F.batch_norm(x, mean, var, weight, bias, False, 0.0, eps)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, mean, var, weight, bias = ctx.saved_tensors
        need_x, need_stats, need_w, need_b = ctx.needs_input_grad[:4]
        with torch.enable_grad():
            xd = x.detach().requires_grad_(need_x)
            w = torch.ones_like(mean) if weight is None else weight.detach()
            b = torch.zeros_like(mean) if bias is None else bias.detach()
            w.requires_grad_(need_stats or need_w)
            b.requires_grad_(need_stats or need_b)
            y = F.batch_norm(xd, mean, var, w, b, False, 0.0, ctx.eps)
            inputs = [t for t in (xd, w, b) if t.requires_grad]
            found = iter(torch.autograd.grad(y, inputs, grad) if inputs else ())
        grad_x = next(found) if xd.requires_grad else None
        grad_w = next(found) if w.requires_grad else None
        grad_b = next(found) if b.requires_grad else None
        grad_stats = None
        if need_stats:
            invstd = torch.rsqrt(var + ctx.eps)
            scale = w.detach() * invstd
            grad_stats = torch.zeros(4, mean.numel(), dtype=ctx.stats_dtype, device=mean.device)
            grad_stats[1] = -scale * grad_b
            grad_stats[2] = -0.5 * scale * invstd * grad_w
        return (grad_x, grad_stats, grad_w if need_w else None, grad_b if need_b else None, None)
