"""What the one-process split layers share: cutting a dimension, and moving a shard's tensors.

Shards are *logical* devices (``["cpu", "cpu"]`` is two); the *home* is the first shard on the
output device, or ``None``. :mod:`tandem.parallel.traffic` counts a move between shards.
"""

from __future__ import annotations

import torch

from tandem.errors import UsageError

from ..parallel import traffic
from ..parallel.shares import shares

#: Traffic kinds recorded by the split layers (forward values, backward gradients).
ACTIVATIONS = "activations"
ACTIVATION_GRADS = "activation_grads"


def split_sizes(total: int, parts: int) -> list[int]:
    """``total`` items in at most ``parts`` near-equal, contiguous, non-empty parts, the first
    ``total % parts`` one larger: 10 over 3 is ``[4, 3, 3]``, 2 over 4 is ``[1, 1]``."""
    if total < 1:
        raise UsageError(f"cannot split {total} features: need at least 1")
    if parts < 1:
        raise UsageError(f"cannot split over {parts} devices: need at least 1")
    return shares(total, [1] * min(total, parts))  # the same balance as a scattered batch


class _Move(torch.autograd.Function):
    """``x.to(device)`` that records its bytes forward and its gradient's bytes backward."""

    @staticmethod
    def forward(ctx, x, device, src, dst):
        ctx.src_device, ctx.src, ctx.dst = x.device, src, dst
        traffic.record(ACTIVATIONS, x.numel() * x.element_size(), dst)
        y = x.to(device)
        # Returning an input unchanged would alias it; a view keeps autograd's bookkeeping right.
        return y.view_as(y) if y is x else y

    @staticmethod
    def backward(ctx, grad):
        traffic.record(ACTIVATION_GRADS, grad.numel() * grad.element_size(), ctx.src)
        return grad.to(ctx.src_device), None, None, None


def move(x: torch.Tensor, device: torch.device, src: int | None, dst: int | None) -> torch.Tensor:
    """Differentiably move ``x`` from logical slot ``src`` to slot ``dst`` on ``device``; its
    bytes are recorded (``activations``, and ``activation_grads`` back) when ``src != dst``."""
    if not traffic.metering() or src == dst:
        return x.to(device)
    return _Move.apply(x, device, src, dst)
