"""CIFAR ResNets from He et al. 2015, section 4.2: 6n+2 layers, widths 16, 32, 64.

Shortcuts are option A (zero-padded, no parameters), so with 10 classes a net has
``97,216 n - 21,926`` parameters. ``num_classes`` defaults to 10; any input of at least 1x1 works.
"""

from __future__ import annotations

from tandem.models.builder import ResNet, ResNetBuilder
from tandem.models.registry import register_model
from tandem.errors import UsageError

WIDTHS = (16, 32, 64)
DEPTHS = {"cifar_resnet20": 20, "cifar_resnet32": 32, "cifar_resnet44": 44,
          "cifar_resnet56": 56, "cifar_resnet110": 110}


def cifar_resnet(depth: int, num_classes: int = 10, in_channels: int = 3,
                 zero_init_residual: bool = False, drop_path: float = 0.0) -> ResNet:
    """Build the ``depth``-layer CIFAR ResNet; ``depth`` must be 6n+2. ``drop_path``:
    stochastic depth's rate at the last block (see :class:`~tandem.models.ResNetBuilder`)."""
    if depth < 8 or (depth - 2) % 6:
        raise UsageError(f"CIFAR ResNet depth must be 6n+2 (20, 32, 44, ...), got {depth}")
    n = (depth - 2) // 6
    b = ResNetBuilder(in_channels, shortcut="zero_pad", zero_init_residual=zero_init_residual,
                      drop_path=drop_path)
    b.add_stem(WIDTHS[0], kernel_size=3, stride=1, max_pool=False)
    for stage, width in enumerate(WIDTHS):
        b.start_stage()
        for i in range(n):
            b.add_basic_block(width, stride=2 if stage > 0 and i == 0 else 1)
    b.add_head(num_classes)
    return b.build()


def _entry(name: str):
    depth = DEPTHS[name]

    def fn(num_classes: int = 10, in_channels: int = 3,
           zero_init_residual: bool = False, drop_path: float = 0.0) -> ResNet:
        return cifar_resnet(depth, num_classes, in_channels, zero_init_residual, drop_path)

    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = f"{name}: {depth} layers (n={(depth - 2) // 6}), 32x32 input, 10 classes."
    return register_model(native_input_size=32, min_input_size=1, family="cifar_resnet")(fn)


cifar_resnet20 = _entry("cifar_resnet20")
cifar_resnet32 = _entry("cifar_resnet32")
cifar_resnet44 = _entry("cifar_resnet44")
cifar_resnet56 = _entry("cifar_resnet56")
cifar_resnet110 = _entry("cifar_resnet110")
