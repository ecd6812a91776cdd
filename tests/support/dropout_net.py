"""A model with dropout small enough to train in milliseconds: what
tests/integration/cli/test_run_lifecycle.py names as ``-a dropout_net:make`` to check that a resume
restores the global RNG its dropout masks draw from (alexnet, the zoo's cheapest model with dropout,
weighs 61M parameters)."""

from torch import nn


def make(num_classes, in_channels, dropout=0.5):
    return nn.Sequential(nn.Conv2d(in_channels, 8, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Dropout(dropout),
                         nn.Linear(32, 16), nn.ReLU(), nn.Dropout(dropout),
                         nn.Linear(16, num_classes))  # [N, num_classes]
