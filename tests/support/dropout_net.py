"""Models with dropout small enough to train in milliseconds: ``-a dropout_net:make`` (what
tests/integration/cli/test_run_lifecycle.py names to check that a resume restores the global
RNG torch's dropout draws from) and ``-a dropout_net:alexnet_like`` (AlexNet's classifier with
its dropout 0.5, behind one conv and a channel dropout: what the keyed-dropout tests train
under every strategy, hybrid's split head included). alexnet, the zoo's cheapest model with
dropout, weighs 61M parameters."""

from torch import nn

from tandem.models.alexnet import AlexNet


def make(num_classes, in_channels, dropout=0.5):
    return nn.Sequential(nn.Conv2d(in_channels, 8, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Dropout(dropout),
                         nn.Linear(32, 16), nn.ReLU(), nn.Dropout(dropout),
                         nn.Linear(16, num_classes))  # [N, num_classes]


def alexnet_like(num_classes, in_channels, dropout=0.5):
    """features (conv, ReLU, Dropout2d of ``dropout / 2``), AlexNet's 6x6 pool and its
    classifier (Dropout, Linear, ReLU, Dropout, Linear, ReLU, Linear) 16 features wide."""
    features = nn.Sequential(nn.Conv2d(in_channels, 4, 3, padding=1), nn.ReLU(),
                             nn.Dropout2d(dropout / 2))
    return AlexNet(features, 4, num_classes, dropout, hidden_features=16)
