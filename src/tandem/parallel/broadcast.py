"""Differentiable parameter copies for replicas: broadcast forward, reduce-add backward.

Each replica gets its own output per parameter, so ONE backward sums their gradients in replica
order (autograd's would follow thread timing, and runs would differ in their last bits).
Replicas on one device share storage (views). Between distinct CUDA devices copies and sums are
coalesced ``torch.cuda.comm`` calls; elsewhere ``to(copy=True)``.
"""

from __future__ import annotations

import torch
import torch.cuda.comm as comm  # a submodule: not loaded by ``import torch``

from .devices import cuda_index


def _coalesced(source: torch.device, targets: list[torch.device]) -> bool:
    """Whether ``torch.cuda.comm`` can do the copies: CUDA to other, distinct CUDA devices."""
    if source.type != "cuda" or any(t.type != "cuda" for t in targets):
        return False
    ordinals = [cuda_index(source)] + [cuda_index(t) for t in targets]
    return len(set(ordinals)) == len(ordinals)


def _copies(params, devices: list[torch.device], share: bool) -> list[list[torch.Tensor]]:
    """One list of tensors per entry of ``devices`` (the storage, before views)."""
    source = params[0].device
    if not share:
        return [[p.to(d, copy=True) for p in params] for d in devices]
    distinct = list(dict.fromkeys(d for d in devices if d != source))
    if distinct and _coalesced(source, distinct):
        ordinals = [cuda_index(source)] + [cuda_index(d) for d in distinct]
        moved = dict(zip(distinct, comm.broadcast_coalesced(params, ordinals)[1:]))
    else:
        moved = {d: [p.to(d, copy=True) for p in params] for d in distinct}
    return [list(params) if d == source else moved[d] for d in devices]


class _Broadcast(torch.autograd.Function):
    """``apply(devices, share, *params)``: one output per (replica, parameter), replica-major.
    Backward sums each parameter's gradients in replica order, per device, then over devices."""

    @staticmethod
    def forward(ctx, devices, share, *params):
        ctx.source, ctx.devices = params[0].device, list(devices)
        per_replica = _copies(params, ctx.devices, share)
        # a view per replica: autograd keeps one gradient per output instead of summing them
        flat = tuple(t.view_as(t) for tensors in per_replica for t in tensors)
        n = len(params)
        frozen = [flat[k * n + j] for k in range(len(ctx.devices))
                  for j, needs in enumerate(ctx.needs_input_grad[2:]) if not needs]
        ctx.mark_non_differentiable(*frozen)
        return flat

    @staticmethod
    def backward(ctx, *grads):
        n = len(grads) // len(ctx.devices)
        by_device: dict = {}
        for k, device in enumerate(ctx.devices):
            by_device.setdefault(device, []).append(grads[k * n:(k + 1) * n])
        sums = {device: [ordered_sum(column) for column in zip(*rows)]
                for device, rows in by_device.items()}
        targets = list(sums)
        if _coalesced(ctx.source, [d for d in targets if d != ctx.source]) and len(targets) > 1:
            # comm refuses a destination holding none of its inputs (the source, when its
            # replica is the module itself): then add on the first copy's device and move
            onto = ctx.source if ctx.source in targets else targets[0]
            total = comm.reduce_add_coalesced([sums[d] for d in targets], cuda_index(onto))
            if onto != ctx.source:
                total = [t.to(ctx.source) for t in total]
        else:
            total = [ordered_sum([sums[d][j] for d in targets], ctx.source) for j in range(n)]
        return (None, None) + tuple(total)


def ordered_sum(tensors, device=None) -> torch.Tensor:
    """``((t0 + t1) + t2) + ...`` on ``device`` (default: the first's), always in this order."""
    first = tensors[0] if device is None else tensors[0].to(device)
    if len(tensors) == 1:
        return first
    total = first.clone() if first is tensors[0] else first
    for t in tensors[1:]:
        total.add_(t if device is None else t.to(device))
    return total


def copy_params(params: list[torch.Tensor], replicas: list[tuple], share: bool = False) -> dict:
    """``{(id(param), replica index): differentiable tensor}`` for ``replicas``, a list of
    ``(replica index, device)``. ``share``: replicas on one device share one copy's storage,
    and those on the parameters' own device share the parameters'."""
    flat = _Broadcast.apply([device for _, device in replicas], share, *params)
    return dict(zip([(id(p), i) for i, _ in replicas for p in params], flat))  # replica-major
