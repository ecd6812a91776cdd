"""Multiply-accumulates (MACs) by torch's ``FlopCounterMode``, and parameters.

Conv and Linear modules only (torchvision's "GFLOPS" conventions); one forward on zeros.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode
from tandem.errors import UsageError

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def mac_breakdown(model: nn.Module, input_size: Sequence[int]) -> dict[str, int]:
    """MACs of every Conv/Linear layer by module name, for an input of ``input_size`` (batch
    included: ``(1, 3, 224, 224)``), in eval mode (the training flag is restored)."""
    shape = tuple(int(s) for s in input_size)
    if not shape or any(s < 1 for s in shape):
        raise UsageError(f"input_size must be a shape of positive ints, got {input_size!r}")
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    dtype = first.dtype if first is not None and first.is_floating_point() else torch.float32

    was_training = model.training
    try:
        model.eval()
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(torch.zeros(shape, device=device, dtype=dtype))
    finally:
        model.train(was_training)
    # The counter keys modules by path from the root's class name: "ResNet.layer1.0.conv1".
    flops = counter.get_flop_counts()
    root = type(model).__name__
    counts = {}
    for name, module in model.named_modules():
        key = f"{root}.{name}" if name else root
        if isinstance(module, _CONVS + (nn.Linear,)) and key in flops:
            counts[name] = sum(flops[key].values()) // 2
    return counts


def count_macs(model: nn.Module, input_size: Sequence[int]) -> int:
    """Total Conv + Linear MACs of one forward pass on an input of shape ``input_size``."""
    return sum(mac_breakdown(model, input_size).values())


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of parameter elements (buffers such as BN running stats are not parameters)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
