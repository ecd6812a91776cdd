"""ImageNet ResNets (He et al. 2015), laid out exactly as torchvision's.

Each variant is a row of :data:`LAYOUTS`; the stride sits on the bottleneck's 3x3 conv ("v1.5")
and parameter counts equal torchvision's. The head pools adaptively, so any input of at least
1x1 works.
"""

from __future__ import annotations

from tandem.models.builder import ResNet, ResNetBuilder
from tandem.models.registry import register_model

WIDTHS = (64, 128, 256, 512)
LAYOUTS: dict[str, tuple[str, tuple[int, int, int, int]]] = {
    "resnet18": ("basic", (2, 2, 2, 2)),
    "resnet34": ("basic", (3, 4, 6, 3)),
    "resnet50": ("bottleneck", (3, 4, 6, 3)),
    "resnet101": ("bottleneck", (3, 4, 23, 3)),
    "resnet152": ("bottleneck", (3, 8, 36, 3)),
}


def imagenet_resnet(layout: str, num_classes: int = 1000, in_channels: int = 3,
                    zero_init_residual: bool = False, drop_path: float = 0.0) -> ResNet:
    """Build the ImageNet ResNet named ``layout`` (a key of :data:`LAYOUTS`); ``drop_path``:
    stochastic depth's rate at the last block (see :class:`ResNetBuilder`)."""
    block, depths = LAYOUTS[layout]
    b = ResNetBuilder(in_channels, shortcut="projection", zero_init_residual=zero_init_residual,
                      drop_path=drop_path)
    b.add_stem(WIDTHS[0], kernel_size=7, stride=2, max_pool=True)
    add = b.add_basic_block if block == "basic" else b.add_bottleneck
    for stage, (depth, width) in enumerate(zip(depths, WIDTHS)):
        b.start_stage()
        for i in range(depth):
            add(width, stride=2 if stage > 0 and i == 0 else 1)
    b.add_head(num_classes)
    return b.build()


def _entry(layout: str):
    def fn(num_classes: int = 1000, in_channels: int = 3,
           zero_init_residual: bool = False, drop_path: float = 0.0) -> ResNet:
        return imagenet_resnet(layout, num_classes, in_channels, zero_init_residual, drop_path)

    fn.__name__ = fn.__qualname__ = layout
    fn.__doc__ = f"{layout}: {LAYOUTS[layout][0]} blocks {LAYOUTS[layout][1]}, 224x224 input."
    return register_model(native_input_size=224, min_input_size=1, family="resnet")(fn)


resnet18 = _entry("resnet18")
resnet34 = _entry("resnet34")
resnet50 = _entry("resnet50")
resnet101 = _entry("resnet101")
resnet152 = _entry("resnet152")
