"""AlexNet's layout in miniature for 1x8x8 digits: features with a BatchNorm, avgpool, and a
classifier of three Linear layers, which hybrid splits into a column/row pair and a gathered
column (a bias on one rank only under hybrid-ddp): ``-a recipe_net:make``, the model on which
the recipe's exactness tests compare strategies (a few thousand weights, no dropout)."""

import torch
from torch import nn


class RecipeNet(nn.Module):
    def __init__(self, num_classes: int, in_channels: int):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(in_channels, 6, 3, padding=1),
                                      nn.BatchNorm2d(6), nn.ReLU(), nn.MaxPool2d(2))
        self.avgpool = nn.AdaptiveAvgPool2d(2)
        self.classifier = nn.Sequential(nn.Linear(24, 16), nn.ReLU(), nn.Linear(16, 12),
                                        nn.ReLU(), nn.Linear(12, num_classes))

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def make(num_classes, in_channels):
    return RecipeNet(num_classes, in_channels)
