"""Differentiable parameter copies for replicas: broadcast forward, reduce-add backward.

Between distinct CUDA devices both directions are coalesced ``torch.cuda.comm`` calls; anywhere
else each copy is a ``to(copy=True)``, which lets tests run the copy-and-reduce path on CPU.
"""

from __future__ import annotations

import torch
import torch.cuda.comm as comm  # a submodule: not loaded by ``import torch``

__all__ = ["copy_params"]


def _cuda_index(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


def _coalesced(source: torch.device, targets: list[torch.device]) -> bool:
    """Whether ``torch.cuda.comm`` can do the copies: CUDA to other, distinct CUDA devices."""
    if source.type != "cuda" or any(t.type != "cuda" for t in targets):
        return False
    ordinals = [_cuda_index(source)] + [_cuda_index(t) for t in targets]
    return len(set(ordinals)) == len(ordinals)


class _Broadcast(torch.autograd.Function):
    """Copy ``params`` (all on one device) to each of ``targets``; backward sums the grads back.

    One coalesced ``comm.broadcast_coalesced`` / ``comm.reduce_add_coalesced`` between CUDA
    devices; elsewhere (CPU, or several copies on one device) a ``to(copy=True)`` per copy and
    a sum on the source device, so the same Function, and its bookkeeping, runs on CPU too.
    """

    @staticmethod
    def forward(ctx, targets, *params):
        ctx.source = params[0].device
        ctx.num_targets = len(targets)
        ctx.coalesced = _coalesced(ctx.source, targets)
        if ctx.coalesced:
            ordinals = [_cuda_index(ctx.source)] + [_cuda_index(t) for t in targets]
            copies = comm.broadcast_coalesced(params, ordinals)[1:]
        else:
            copies = [[p.to(t, copy=True) for p in params] for t in targets]
        flat = tuple(t for per_target in copies for t in per_target)
        frozen = [flat[k * len(params) + j] for k in range(len(targets))
                  for j, needs in enumerate(ctx.needs_input_grad[1:]) if not needs]
        ctx.mark_non_differentiable(*frozen)
        return flat

    @staticmethod
    def backward(ctx, *grads):
        n = len(grads) // ctx.num_targets
        per_target = [grads[k * n:(k + 1) * n] for k in range(ctx.num_targets)]
        if ctx.coalesced:
            return (None,) + tuple(comm.reduce_add_coalesced(per_target, _cuda_index(ctx.source)))
        summed = []
        for column in zip(*per_target):
            total = column[0].to(ctx.source, copy=True)
            for g in column[1:]:
                total.add_(g.to(ctx.source))
            summed.append(total)
        return (None,) + tuple(summed)


def copy_params(params: list[torch.Tensor], slots: list) -> dict:
    """``{(id(param), replica index): differentiable copy}``; ``slots`` pairs each target
    device with the replicas that share its copy."""
    out: dict = {}
    flat = _Broadcast.apply([device for device, _ in slots], *params)
    for k, (_, replicas) in enumerate(slots):
        for j, p in enumerate(params):
            for i in replicas:
                out[id(p), i] = flat[k * len(params) + j]
    return out
