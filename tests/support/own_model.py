"""A model and data sets of a user's own, not tandem's zoo: what tests/integration/cli/test_fit.py
hands to ``tandem.fit`` and tests/integration/cli/test_factories.py names as
``-a own_model:make_net`` and ``--data own_model:pairs`` (plus factories that are wrong in each
way the CLI reports)."""

import torch
from torch import nn
from torch.utils.data import Dataset


class Net(nn.Module):
    """conv, BatchNorm (so that dp without sync_bn is a different update), pool, linear."""

    def __init__(self, num_classes=3, in_channels=1):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(in_channels, 6, 3, padding=1),
                                      nn.BatchNorm2d(6), nn.ReLU(), nn.AdaptiveAvgPool2d(2))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(24, 12), nn.ReLU(),
                                        nn.Linear(12, num_classes))

    def forward(self, x):
        return self.classifier(self.features(x))  # [N, num_classes]


class Pairs(Dataset):
    """``n`` (input, target) pairs: float32 [1, 8, 8] noise whose class shifts its mean."""

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.targets = torch.randint(0, 3, (n,), generator=g)
        self.inputs = torch.randn(n, 1, 8, 8, generator=g) + self.targets[:, None, None, None]

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, i):
        return self.inputs[i], int(self.targets[i])


def make_net(num_classes, in_channels):
    return Net(num_classes, in_channels)


def pairs():
    return Pairs(30, seed=0), Pairs(11, seed=1), ("a", "b", "c")


def needs_depth(depth, num_classes=3):
    return Net(num_classes)


def not_a_model(num_classes=3):
    return "a string"


def not_data():
    return 42


class ChangedInEval(Net):
    """``Net`` whose eval logits (never its training ones) go through ``change``."""

    def __init__(self, num_classes, in_channels, change):
        super().__init__(num_classes, in_channels)
        self.change = change

    def forward(self, x):
        out = super().forward(x)
        return out if self.training else self.change(out)


def overflows_in_eval(num_classes, in_channels):
    """Infinite eval logits, as fp16 logits past 65504 are."""
    return ChangedInEval(num_classes, in_channels, lambda out: out + float("inf"))


def huge_in_eval(num_classes, in_channels):
    """Eval logits scaled past fp16's 65504 inside the model (so under fp16 autocast they
    overflow there, as early BatchNorm statistics made resnet50's do)."""
    return ChangedInEval(num_classes, in_channels, lambda out: out * 1e6)


class SmoothNet(nn.Module):
    """``Net`` with tanh and average pooling: no ReLU or max-pool threshold for float32 rounding
    to cross, so a float32 run's distance from float64 measures rounding alone."""

    def __init__(self, num_classes=3, in_channels=1):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(in_channels, 6, 3, padding=1),
                                      nn.BatchNorm2d(6), nn.Tanh(),
                                      nn.Conv2d(6, 6, 3, padding=1), nn.BatchNorm2d(6),
                                      nn.Tanh(), nn.AdaptiveAvgPool2d(2))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(24, 12), nn.Tanh(),
                                        nn.Linear(12, num_classes))

    def forward(self, x):
        return self.classifier(self.features(x))


def smooth_net(num_classes, in_channels):
    return SmoothNet(num_classes, in_channels)
