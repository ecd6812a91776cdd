"""VGG (Simonyan & Zisserman 2014) in torchvision's layout: a row of :data:`CFGS` lists the conv
widths, ``"M"`` a max-pool; ``_bn`` variants add BatchNorm after each conv (keeping its bias).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from tandem.models.alexnet import check_dropout
from tandem.models.builder import on_meta
from tandem.models.registry import register_model

CFGS: dict[str, list[int | str]] = {
    "vgg11": [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "vgg13": [64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "vgg16": [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M",
              512, 512, 512, "M"],
    "vgg19": [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M",
              512, 512, 512, 512, "M"]}


def make_features(cfg: list[int | str], in_channels: int, batch_norm: bool) -> nn.Sequential:
    """The conv stack for one row of :data:`CFGS`."""
    layers: list[nn.Module] = []
    for v in cfg:
        if v == "M":
            layers.append(nn.MaxPool2d(2, stride=2))
            continue
        layers.append(nn.Conv2d(in_channels, int(v), 3, padding=1))
        if batch_norm:
            layers.append(nn.BatchNorm2d(int(v)))
        layers.append(nn.ReLU(inplace=True))
        in_channels = int(v)
    return nn.Sequential(*layers)


class VGG(nn.Module):
    """``features`` (conv stack), ``avgpool`` (adaptive, 7x7) and ``classifier`` (FC stack)."""

    def __init__(self, features: nn.Sequential, num_classes: int, dropout: float,
                 hidden_features: int):
        super().__init__()
        check_dropout(dropout)
        self.features = features
        self.avgpool = nn.AdaptiveAvgPool2d(7)
        # ReLUs not in place: see alexnet.make_classifier (hybrid parallelism feeds this).
        self.classifier = nn.Sequential(
            nn.Linear(512 * 7 * 7, hidden_features), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden_features, hidden_features), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(hidden_features, num_classes))
        self._init_weights()

    def _init_weights(self) -> None:
        if on_meta(self):  # shapes only: nothing to set
            return
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0.0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)  # N, 512, h/32, w/32
        x = self.avgpool(x)  # N, 512, 7, 7
        x = torch.flatten(x, 1)  # N, 25088
        return self.classifier(x)  # N, num_classes


def vgg(name: str, num_classes: int = 1000, in_channels: int = 3, dropout: float = 0.5,
        hidden_features: int = 4096) -> VGG:
    """VGG ``name`` (a row of :data:`CFGS`, ``_bn`` for BatchNorm); 224x224, at least 32x32."""
    features = make_features(CFGS[name.removesuffix("_bn")], in_channels, name.endswith("_bn"))
    return VGG(features, num_classes, dropout, hidden_features)


for _name in (n + bn for n in CFGS for bn in ("", "_bn")):
    register_model(native_input_size=224, min_input_size=32, family="vgg",
                   name=_name)(partial(vgg, _name))
