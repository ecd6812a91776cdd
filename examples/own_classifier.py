"""A classifier of your own, trained by tandem: a small CNN on scikit-learn's 8x8 digits.

``tandem.fit`` trains it with two CPU replicas (``dp``, batch norm synchronised), stops after
40 steps as an interrupted run would, and a second ``tandem.fit(..., resume=OUT)`` continues
it to the end in the same run directory: the same weights as one straight run. From the
repository root (about 10 s on 2 CPU cores)::

    python examples/own_classifier.py [OUT]

The same model and data from the command line (``-a`` and ``--data`` take
``package.module:function``; ``SmallCNN`` is called with ``num_classes`` and ``in_channels``)::

    tandem train -a examples.own_classifier:SmallCNN --data examples.own_classifier:digits \\
        --strategy dp --devices cpu:2 --sync-bn --epochs 8 --out runs/own_cli
"""

import sys

import torch
from torch import nn

import tandem
from tandem.data import load_dataset


class SmallCNN(nn.Module):
    """Two conv blocks with batch norm, then a linear classifier: about 10k parameters."""

    def __init__(self, num_classes=10, in_channels=1):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.MaxPool2d(2))                                     # [N, 32, 4, 4]
        self.classifier = nn.Sequential(nn.Flatten(), nn.Dropout(0.0),
                                        nn.Linear(32 * 4 * 4, num_classes))

    def forward(self, x):                                        # x: [N, 1, 8, 8]
        return self.classifier(self.features(x))                 # [N, num_classes]


def digits():
    """tandem's bundled digits (1,438 train / 359 val images, nothing downloaded) as map-style
    (image, label) data sets, with the class names."""
    train, val, info = load_dataset("digits", augment="standard")
    return train, val, info.classes


def main(out: str = "runs/own_classifier") -> dict:
    train, val, classes = digits()
    settings = dict(strategy="dp", devices="cpu:2", sync_bn=True, batch_size=64, epochs=8,
                    lr=0.02, out=out, no_progress=True)
    torch.manual_seed(0)  # your model's initial weights are yours: seed them
    tandem.fit(SmallCNN(), train, val, classes=classes, **settings, overwrite=True,
               max_steps=40)                                     # stops in epoch 2 of 8
    model = SmallCNN()
    row = tandem.fit(model, train, val, classes=classes, resume=out)  # continues to epoch 8
    print(f"val acc {row['val_acc']:.2f}% after {row['step']} steps; the trained model is "
          f"`model` and {out}/checkpoint.pt")
    return row


if __name__ == "__main__":
    main(*sys.argv[1:2])
