"""A tiny net with batch norm, its batches, and two SGD steps through a strategy: the run on
which each strategy is compared with `single` (tests/unit/strategies/test_strategies.py,
tests/unit/parallel/test_split.py)."""

import torch
from torch import nn

from tandem.checkpoint import plain_state_dict  # what checkpoints store


class Tiny(nn.Module):
    """features / avgpool / classifier, like AlexNet and VGG, with batch norm in features."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(),
                                      nn.MaxPool2d(2))
        self.avgpool = nn.AdaptiveAvgPool2d(2)
        self.classifier = nn.Sequential(nn.Linear(24, 10), nn.ReLU(), nn.Linear(10, 5))

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def run_steps(strategy, model, batches):
    """Two SGD(momentum) steps through ``strategy``; returns outputs and the plain state."""
    wrapped = strategy.setup(model)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    outs = []
    wrapped.train()
    for images, targets in batches:
        out = strategy.forward_loss(wrapped, criterion, images, targets)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        outs.append((out.loss.item(), int(out.correct), out.count))
    wrapped.eval()
    with torch.no_grad():
        out = strategy.forward_loss(wrapped, criterion, *batches[0])
    outs.append((out.loss.item(), int(out.correct), out.count))
    return outs, {k: v.detach().clone() for k, v in plain_state_dict(wrapped).items()}


def make_batches(n):
    g = torch.Generator().manual_seed(n)
    return [(torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 5, (n,), generator=g))
            for _ in range(2)]
