"""Semantic segmentation with tandem: a small fully-convolutional net on drawn shapes.

The data is drawn here: circles and squares on noise, 3 classes (background, circle, square);
each shape's 1-pixel outline is ignored (``IGNORE = 255``), as VOC marks object borders. The net
returns ``(N, 3, H, W)`` logits for ``(N, H, W)`` targets; ``balanced`` keeps each device's
logits where they are and sends device 0 only the loss terms and a 3x3 confusion matrix.

    python examples/segmentation.py                                  # balanced over cpu:3
    python examples/segmentation.py --strategy single --devices cpu
    python examples/segmentation.py --strategy dp --devices cuda:0,1
    tandem launch --nproc-per-node 2 -- train -a examples.segmentation:make_net \
        --data examples.segmentation:make_data --strategy ddp --devices cpu --sync-bn \
        --ignore-index 255 --label-smoothing 0 --out runs/segmentation-ddp

``make_net`` and ``make_data`` are the factories: this script hands what they make to
``tandem.fit``; the command line names them (from the repository's root).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import TensorDataset

import tandem

__all__ = ["NUM_CLASSES", "IGNORE", "CLASSES", "draw_shapes", "make_data", "make_net", "SegNet",
           "train"]

NUM_CLASSES = 3  # background, circle, square
IGNORE = 255  # shape outlines: neither inside nor outside


def draw_shapes(count: int, size: int = 32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` noisy ``(3, size, size)`` float images and their ``(size, size)`` masks.

    Each image holds one to three shapes, a circle or a square of random colour, radius and
    place; later shapes cover earlier ones. Pixels within half a pixel of a shape's edge are
    ``IGNORE``."""
    g = torch.Generator().manual_seed(seed)
    images = torch.rand(count, 3, size, size, generator=g) * 0.6
    masks = torch.zeros(count, size, size, dtype=torch.long)
    ys, xs = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    for i in range(count):
        for _ in range(int(torch.randint(1, 4, (), generator=g))):
            kind = int(torch.randint(1, 3, (), generator=g))  # 1 circle, 2 square
            r = float(torch.empty(()).uniform_(3.0, size / 4, generator=g))
            cy, cx = (torch.rand(2, generator=g) * (size - 2 * r) + r).tolist()
            # distance from the centre: Euclidean for a circle, Chebyshev for a square
            d = (torch.hypot(ys - cy, xs - cx) if kind == 1
                 else torch.maximum((ys - cy).abs(), (xs - cx).abs()))
            inside, edge = d < r - 0.5, (d - r).abs() <= 0.5
            colour = torch.rand(3, 1, generator=g) * 0.7 + 0.3
            images[i][:, inside | edge] = colour + 0.2 * torch.rand(3, int((inside | edge).sum()),
                                                                    generator=g)
            masks[i][inside] = kind
            masks[i][edge] = IGNORE
    return images, masks


CLASSES = ("background", "circle", "square")


def make_data(train: int = 768, val: int = 128, size: int = 32, seed: int = 0):
    """The data factory: ``(train, val, class names)``, data sets of ``(image, mask)`` pairs
    (drawn, deterministic); the names tell tandem the class count (masks also hold 255)."""
    train_set = TensorDataset(*draw_shapes(train, size, seed))
    val_set = TensorDataset(*draw_shapes(val, size, seed + 1))
    return train_set, val_set, CLASSES


def _block(cin: int, cout: int, **kw) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, 3, padding=kw.pop("padding", 1), bias=False, **kw),
            nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]


class SegNet(nn.Module):
    """Encoder (full and half resolution), dilated context blocks, a decoder with a skip."""

    def __init__(self, num_classes: int = NUM_CLASSES, in_channels: int = 3, width: int = 16):
        super().__init__()
        self.stem = nn.Sequential(*_block(in_channels, width))
        self.down = nn.Sequential(*_block(width, 2 * width, stride=2),
                                  *_block(2 * width, 2 * width, padding=2, dilation=2),
                                  *_block(2 * width, 2 * width, padding=4, dilation=4))
        self.up = nn.ConvTranspose2d(2 * width, width, 2, stride=2)
        self.fuse = nn.Sequential(*_block(2 * width, width))
        self.classifier = nn.Conv2d(width, num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.stem(x)  # N, w, H, W
        x = self.up(self.down(skip))  # N, w, H, W (H and W even)
        return self.classifier(self.fuse(torch.cat([x, skip], 1)))  # N, classes, H, W


def make_net(num_classes: int = NUM_CLASSES, in_channels: int = 3) -> nn.Module:
    """The model factory: a :class:`SegNet`."""
    return SegNet(num_classes, in_channels)


def train(strategy: str = "balanced", devices: str = "cpu:3", epochs: int = 12,
          batch_size: int = 32, lr: float = 0.1, sync_bn: bool = True, seed: int = 0,
          out: str = "runs/segmentation") -> dict:
    """Train ``make_net()`` on ``make_data()`` with ``tandem.fit`` into ``out`` (replaced);
    returns the last validation's loss, pixel accuracy and mean IoU (percent), each over the
    whole validation set."""
    torch.manual_seed(seed)
    train_set, val_set, classes = make_data()
    row = tandem.fit(make_net(len(classes), 3), train_set, val_set, classes=classes,
                     strategy=strategy, devices=devices, sync_bn=sync_bn, epochs=epochs,
                     batch_size=batch_size, lr=lr, seed=seed, ignore_index=IGNORE,
                     label_smoothing=0.0, out=out, overwrite=True, no_progress=True)
    return {"loss": row["val_loss"], "pixel_acc": row["val_acc"], "miou": row["val_miou"]}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="balanced")
    parser.add_argument("--devices", default="cpu:3")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("-b", "--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--no-sync-bn", dest="sync_bn", action="store_false")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/segmentation")
    args = parser.parse_args(argv)
    final = train(args.strategy, args.devices, args.epochs, args.batch_size, args.lr,
                  args.sync_bn, args.seed, args.out)
    print(f"final: val loss {final['loss']:.4f} pixel acc {final['pixel_acc']:.2f}% "
          f"mIoU {final['miou']:.2f}%")
    return final


if __name__ == "__main__":
    main()
