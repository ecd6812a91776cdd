"""CIFAR ResNets (He et al. 2015, section 4.2): 6n+2 layers, widths 16, 32, 64, option-A
(zero-padded) shortcuts; with 10 classes ``97,216 n - 21,926`` parameters.
"""

from __future__ import annotations

from functools import partial

from tandem.models.builder import ResNet, ResNetBuilder
from tandem.models.registry import register_model
from tandem.errors import UsageError

WIDTHS = (16, 32, 64)
DEPTHS = {"cifar_resnet20": 20, "cifar_resnet32": 32, "cifar_resnet44": 44,
          "cifar_resnet56": 56, "cifar_resnet110": 110}


def cifar_resnet(depth: int, num_classes: int = 10, in_channels: int = 3,
                 zero_init_residual: bool = False, drop_path: float = 0.0) -> ResNet:
    """The ``depth``-layer CIFAR ResNet (6n+2; 32x32 input, any of at least 1x1 works)."""
    if depth < 8 or (depth - 2) % 6:
        raise UsageError(f"CIFAR ResNet depth must be 6n+2 (20, 32, 44, ...), got {depth}")
    b = ResNetBuilder(in_channels, shortcut="zero_pad", zero_init_residual=zero_init_residual,
                      drop_path=drop_path)
    b.add_stem(WIDTHS[0], kernel_size=3, stride=1, max_pool=False)
    return b.add_stages("basic", [(depth - 2) // 6] * 3, WIDTHS).add_head(num_classes).build()


for _name, _depth in DEPTHS.items():
    register_model(native_input_size=32, min_input_size=1, family="cifar_resnet",
                   name=_name)(partial(cifar_resnet, _depth))
