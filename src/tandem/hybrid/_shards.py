"""Pieces shared by the model-parallel layers: splitting a dimension, moving and running shards.

Shards are *logical* devices (``["cpu", "cpu"]`` is two shards); the *home* is the first shard
on the output device, or ``None``. Moves between different shards are counted by
:mod:`tandem.parallel.traffic` even on one physical device.
"""

from __future__ import annotations

from typing import Sequence

import torch

from tandem.errors import UsageError

from ..parallel import traffic
from ..parallel.devices import index_of
from ..parallel.parallel_apply import parallel_apply
from ..parallel.shares import shares

__all__ = ["split_sizes", "home_index", "move", "run_shards", "check_plain_keys", "ACTIVATIONS",
           "ACTIVATION_GRADS"]

#: Traffic kinds recorded by the model-parallel layers (forward values, backward gradients).
ACTIVATIONS = "activations"
ACTIVATION_GRADS = "activation_grads"


def split_sizes(total: int, parts: int) -> list[int]:
    """Split ``total`` items into at most ``parts`` non-empty, near-equal, contiguous parts.

    The first ``total % parts`` parts get one extra item: 10 over 3 is ``[4, 3, 3]``. When
    ``total < parts`` only ``total`` parts of size 1 are returned (2 over 4 is ``[1, 1]``), so
    a shard never holds an empty slice.
    """
    if total < 1:
        raise UsageError(f"cannot split {total} features: need at least 1")
    if parts < 1:
        raise UsageError(f"cannot split over {parts} devices: need at least 1")
    return shares(total, [1] * min(total, parts))  # the same balance as a scattered batch


def home_index(devices: Sequence[torch.device], output_device: torch.device) -> int | None:
    """The logical slot of ``output_device`` among ``devices`` (first match), or ``None``."""
    return index_of(output_device, devices)


class _Move(torch.autograd.Function):
    """``x.to(device)`` that records its bytes forward and its gradient's bytes backward."""

    @staticmethod
    def forward(ctx, x, device, src, dst):
        ctx.src_device, ctx.src, ctx.dst = x.device, src, dst
        if src != dst:
            traffic.record(ACTIVATIONS, x.numel() * x.element_size(), dst)
        y = x.to(device)
        # Returning an input unchanged would alias it; a view keeps autograd's bookkeeping right.
        return y.view_as(y) if y is x else y

    @staticmethod
    def backward(ctx, grad):
        if ctx.src != ctx.dst:
            traffic.record(ACTIVATION_GRADS, grad.numel() * grad.element_size(), ctx.src)
        return grad.to(ctx.src_device), None, None, None


def move(x: torch.Tensor, device: torch.device, src: int | None, dst: int | None) -> torch.Tensor:
    """Differentiably move ``x`` from logical slot ``src`` to slot ``dst`` on ``device``.

    Bytes are recorded (forward as ``activations``, backward as ``activation_grads``) only
    when ``src != dst``; with no :class:`~tandem.parallel.traffic.TrafficMeter` open this is a
    plain, differentiable ``x.to(device)``.
    """
    if not traffic.metering() or src == dst:
        return x.to(device)
    return _Move.apply(x, device, src, dst)


def run_shards(modules: Sequence[torch.nn.Module], inputs: Sequence[torch.Tensor],
               devices: Sequence[torch.device]) -> list[torch.Tensor]:
    """Run ``modules[j](inputs[j])`` for every shard in its own thread, on the engine.

    One shard runs inline (no thread, its device the current one). An error is re-raised by
    the engine's ``parallel_apply`` with a message naming the replica (shard) and its device.
    """
    return list(parallel_apply(list(modules), [(x,) for x in inputs], devices=list(devices)))


def check_plain_keys(keys, state: dict, what: str) -> None:
    """Refuse, in one line, a plain state dict whose keys are not ``keys`` (a split model's
    plain layout): how many are missing and unexpected, with an example of each."""
    missing = [k for k in keys if k not in state]
    unexpected = [k for k in state if k not in keys]
    if missing or unexpected:
        raise UsageError(f"plain state dict does not fit {what}: {len(missing)} missing "
                         f"(e.g. {missing[:1]}), {len(unexpected)} unexpected "
                         f"(e.g. {unexpected[:1]})")
