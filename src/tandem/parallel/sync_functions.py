"""Batch moments and the one autograd Function that merges them across replicas and processes.

A *part* is one replica's share of a batch, summarised per channel as a ``(3, C)`` tensor of
rows ``[count, mean, m2]``, where ``m2`` is the sum of squared deviations from the part's own
mean. Parts are merged with Chan et al.'s pairwise formula::

    n    = sum n_p
    mean = sum n_p * mean_p / n
    m2   = sum m2_p + sum n_p * (mean_p - mean) ** 2

This is the same information as (count, sum, sum of squares), but it never subtracts two large
sums of squares, so a channel whose mean is large next to its spread keeps its precision.

:class:`GlobalMoments` is the only place replicas meet in autograd. Its inputs are *every*
replica's part and its outputs are the merged moments, one copy per replica device. Because
there is one node, replicas that share a device (and so share one autograd thread) need no
barrier in backward: the engine sums their gradients into the node and runs it once. Across
processes the node all-gathers parts in forward and all-reduces the gradient of the merged
moments in backward, so every process must run backward through it (see ``anchor``).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

__all__ = ["accumulation_dtype", "local_moments", "merge_moments", "GlobalMoments"]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype moments are merged in: float64 for half precision, else at least float32."""
    if dtype in (torch.float16, torch.bfloat16):
        return torch.float64
    if dtype == torch.float64:
        return torch.float64
    return torch.float32


def local_moments(x: torch.Tensor) -> torch.Tensor:
    """``[count, mean, m2]`` per channel of ``x`` (shape ``(N, C, *)``), differentiable in ``x``.

    Half-precision inputs are reduced in float32 (two-pass ``var_mean``, so no cancellation) and
    returned in float64. An empty batch gives count 0, mean 0 and m2 0, still connected to ``x``.
    """
    acc = accumulation_dtype(x.dtype)
    dims = [0, *range(2, x.dim())]
    count = x.numel() // max(x.size(1), 1)
    if count == 0:
        # Sum over nothing is zeros; keeps the autograd connection to x (grad is empty anyway).
        zeros = x.sum(dim=dims, dtype=acc)
        return torch.stack([zeros, zeros, zeros])
    work = x if x.dtype in (torch.float32, torch.float64) else x.float()
    var, mean = torch.var_mean(work, dim=dims, correction=0)
    mean = mean.to(acc)
    m2 = var.to(acc) * count
    return torch.stack([torch.full_like(mean, count), mean, m2])


def merge_moments(parts: torch.Tensor) -> torch.Tensor:
    """Merge stacked parts ``(P, 3, C)`` into one ``(3, C)``; empty parts weigh nothing."""
    n_p, mean_p, m2_p = parts.unbind(1)
    n = n_p.sum(0)
    mean = (n_p * mean_p).sum(0) / n.clamp(min=1)
    m2 = m2_p.sum(0) + (n_p * (mean_p - mean) ** 2).sum(0)
    return torch.stack([n, mean, m2])


def _merge_grads(parts: torch.Tensor, merged: torch.Tensor, g_mean, g_m2) -> torch.Tensor:
    """Gradients of ``merge_moments`` w.r.t. each part ``(P, 3, C)``, given those of the result.

    d mean / d mean_p = n_p / n, d m2 / d mean_p = 2 n_p (mean_p - mean) (the cross term vanishes
    because sum n_j (mean_j - mean) = 0) and d m2 / d m2_p = 1. Counts get no gradient.
    """
    n_p, mean_p, _ = parts.unbind(1)
    n, mean, _ = merged.unbind(0)
    grad_mean = g_mean * n_p / n.clamp(min=1) + g_m2 * 2 * n_p * (mean_p - mean)
    grad_m2 = g_m2.expand_as(grad_mean)
    return torch.stack([torch.zeros_like(grad_mean), grad_mean, grad_m2], dim=1)


class GlobalMoments(torch.autograd.Function):
    """Merge every replica's part (and, with ``group``, every process's) into global moments.

    ``apply(group, devices, anchor, *parts)``: ``parts[i]`` is replica ``i``'s ``(3, C)`` part;
    output ``i`` is the merged ``(3, C)`` moments on ``devices[i]``. ``group`` is a
    ``torch.distributed`` process group or ``None``. ``anchor`` is ``None`` or a scalar that
    requires grad: across processes, every process must reach this node in backward (it
    all-reduces there), even one whose parts need no gradient, such as a rank with an empty batch.

    Forward runs one ``all_gather`` of a ``(3, C)`` tensor per process, backward one
    ``all_reduce`` of a ``(2, C)`` tensor; neither waits for the other replica threads.
    """

    @staticmethod
    def forward(ctx, group, devices: Sequence[torch.device], anchor, *parts):
        home = parts[0].device
        local = torch.stack([p.to(home) for p in parts])  # (P, 3, C)
        merged = merge_moments(local)  # this process's replicas, (3, C)
        if group is not None:
            gathered = [torch.empty_like(merged) for _ in range(dist.get_world_size(group))]
            dist.all_gather(gathered, merged.contiguous(), group=group)
            total = merge_moments(torch.stack(gathered))
        else:
            total = merged
        ctx.group = group
        ctx.devices = [p.device for p in parts]
        ctx.save_for_backward(local, merged, total)
        # A copy per output: autograd must not see one tensor returned twice.
        return tuple(total.to(device, copy=True) for device in devices)

    @staticmethod
    def backward(ctx, *grads):
        local, merged, total = ctx.saved_tensors
        home = local.device
        grad = torch.zeros_like(total)
        for g in grads:
            if g is not None:
                grad += g.to(home)
        g_mean, g_m2 = grad[1], grad[2]
        if ctx.group is not None:
            # Every process's loss depends on the global moments: sum their gradients, then
            # take this process's share of the merge over processes.
            both = torch.stack([g_mean, g_m2])
            dist.all_reduce(both, group=ctx.group)
            share = _merge_grads(merged.unsqueeze(0), total, both[0], both[1])[0]
            g_mean, g_m2 = share[1], share[2]
        part_grads = _merge_grads(local, merged, g_mean, g_m2)
        out = [
            part_grads[i].to(device) if ctx.needs_input_grad[3 + i] else None
            for i, device in enumerate(ctx.devices)
        ]
        return (None, None, None, *out)
