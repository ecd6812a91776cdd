"""ImageNet ResNets (He et al. 2015), laid out as torchvision's ("v1.5": the stride on the
bottleneck's 3x3), parameter for parameter; each a row of :data:`LAYOUTS`.
"""

from __future__ import annotations

from functools import partial

from tandem.models.builder import ResNet, ResNetBuilder
from tandem.models.registry import register_model

WIDTHS = (64, 128, 256, 512)
LAYOUTS: dict[str, tuple[str, tuple[int, int, int, int]]] = {
    "resnet18": ("basic", (2, 2, 2, 2)),
    "resnet34": ("basic", (3, 4, 6, 3)),
    "resnet50": ("bottleneck", (3, 4, 6, 3)),
    "resnet101": ("bottleneck", (3, 4, 23, 3)),
    "resnet152": ("bottleneck", (3, 8, 36, 3))}


def imagenet_resnet(layout: str, num_classes: int = 1000, in_channels: int = 3,
                    zero_init_residual: bool = False, drop_path: float = 0.0) -> ResNet:
    """The ImageNet ResNet ``layout`` (224x224 input; any of at least 1x1 works)."""
    block, depths = LAYOUTS[layout]
    b = ResNetBuilder(in_channels, shortcut="projection", zero_init_residual=zero_init_residual,
                      drop_path=drop_path)
    b.add_stem(WIDTHS[0], kernel_size=7, stride=2, max_pool=True)
    return b.add_stages(block, depths, WIDTHS).add_head(num_classes).build()


for _name in LAYOUTS:
    register_model(native_input_size=224, min_input_size=1, family="resnet",
                   name=_name)(partial(imagenet_resnet, _name))
