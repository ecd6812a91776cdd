"""AlexNet: torchvision's single tower, and Krizhevsky 2012's two towers (``groups=2``, LRN).

``forward`` is ``classifier(flatten(avgpool(features(x)), 1))``, so hybrid can split the rest.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.models.registry import register_model
from tandem.errors import UsageError


def make_classifier(in_features: int, hidden_features: int, num_classes: int,
                    dropout: float) -> nn.Sequential:
    """AlexNet's fc6-fc8; the ReLUs are not in place: under hybrid parallelism their inputs
    are outputs of cross-device autograd functions."""
    return nn.Sequential(
        nn.Dropout(dropout), nn.Linear(in_features, hidden_features), nn.ReLU(),
        nn.Dropout(dropout), nn.Linear(hidden_features, hidden_features), nn.ReLU(),
        nn.Linear(hidden_features, num_classes))


class AlexNet(nn.Module):
    """``features`` (conv stack), ``avgpool`` (adaptive, 6x6) and ``classifier`` (FC stack)."""

    def __init__(self, features: nn.Sequential, out_channels: int, num_classes: int,
                 dropout: float, hidden_features: int):
        super().__init__()
        self.features = features
        self.avgpool = nn.AdaptiveAvgPool2d(6)
        self.classifier = make_classifier(out_channels * 6 * 6, hidden_features, num_classes,
                                          dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)  # N, 256, h, w
        x = self.avgpool(x)  # N, 256, 6, 6
        x = torch.flatten(x, 1)  # N, 9216
        return self.classifier(x)  # N, num_classes


def check_dropout(dropout: float) -> None:
    if not 0.0 <= dropout < 1.0:
        raise UsageError(f"dropout must be in [0, 1), got {dropout!r}")


@register_model(native_input_size=224, min_input_size=63, family="alexnet")
def alexnet(num_classes: int = 1000, in_channels: int = 3, dropout: float = 0.5,
            hidden_features: int = 4096) -> AlexNet:
    """torchvision's AlexNet layout (a single tower, no LRN); 61,100,840 parameters."""
    check_dropout(dropout)
    features = nn.Sequential(
        nn.Conv2d(in_channels, 64, 11, stride=4, padding=2), nn.ReLU(inplace=True),
        nn.MaxPool2d(3, stride=2),
        nn.Conv2d(64, 192, 5, padding=2), nn.ReLU(inplace=True),
        nn.MaxPool2d(3, stride=2),
        nn.Conv2d(192, 384, 3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(384, 256, 3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(inplace=True),
        nn.MaxPool2d(3, stride=2))
    return AlexNet(features, 256, num_classes, dropout, hidden_features)


@register_model(native_input_size=227, min_input_size=67, family="alexnet")
def alexnet_grouped(num_classes: int = 1000, in_channels: int = 3, dropout: float = 0.5,
                    hidden_features: int = 4096) -> AlexNet:
    """Krizhevsky 2012's two-tower AlexNet (groups=2 on conv2/4/5, LRN); 60,965,224 params."""
    check_dropout(dropout)

    def lrn() -> nn.LocalResponseNorm:
        # the paper's k=2, n=5, alpha=1e-4, beta=0.75; torch divides alpha by n
        return nn.LocalResponseNorm(size=5, alpha=5e-4, beta=0.75, k=2.0)

    features = nn.Sequential(
        nn.Conv2d(in_channels, 96, 11, stride=4), nn.ReLU(inplace=True), lrn(),
        nn.MaxPool2d(3, stride=2),
        nn.Conv2d(96, 256, 5, padding=2, groups=2), nn.ReLU(inplace=True), lrn(),
        nn.MaxPool2d(3, stride=2),
        nn.Conv2d(256, 384, 3, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(384, 384, 3, padding=1, groups=2), nn.ReLU(inplace=True),
        nn.Conv2d(384, 256, 3, padding=1, groups=2), nn.ReLU(inplace=True),
        nn.MaxPool2d(3, stride=2))
    return AlexNet(features, 256, num_classes, dropout, hidden_features)
