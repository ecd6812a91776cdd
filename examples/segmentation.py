"""Semantic segmentation with tandem: a small fully-convolutional net on drawn shapes.

The data is drawn here: circles and squares on noise, 3 classes (background, circle, square);
each shape's 1-pixel outline is ignored (``IGNORE = 255``), as VOC marks object borders. The net
returns ``(N, 3, H, W)`` logits for ``(N, H, W)`` targets; ``balanced`` keeps each device's
logits where they are and sends device 0 only the loss terms and a 3x3 confusion matrix.

    python examples/segmentation.py                                  # balanced over cpu:3
    python examples/segmentation.py --strategy single --devices cpu
    python examples/segmentation.py --strategy dp --devices cuda:0,1

``make_net`` and ``make_data`` are the factories a run needs, at module level so that
``tandem.fit`` / ``tandem train -a examples.segmentation:make_net`` can call them.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tandem.parallel.devices import parse_device_spec
from tandem.strategies import create_strategy
from tandem.train.metrics import Meter

__all__ = ["NUM_CLASSES", "IGNORE", "draw_shapes", "make_data", "make_net", "SegNet", "train"]

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


def make_data(train: int = 768, val: int = 128, size: int = 32, seed: int = 0):
    """``(train, val)`` datasets of ``(image, mask)`` pairs (drawn, deterministic)."""
    train_set = TensorDataset(*draw_shapes(train, size, seed))
    val_set = TensorDataset(*draw_shapes(val, size, seed + 1))
    return train_set, val_set


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
          verbose: bool = True) -> dict:
    """Train ``make_net()`` on ``make_data()``; returns the last validation's loss, pixel
    accuracy and mean IoU (percent), each over the whole validation set."""
    torch.manual_seed(seed)
    train_set, val_set = make_data()
    criterion = nn.CrossEntropyLoss(ignore_index=IGNORE)
    with create_strategy(strategy, parse_device_spec(devices, "devices"),
                         sync_bn=sync_bn) as s:
        wrapped = s.setup(make_net(NUM_CLASSES, 3))
        optimizer = torch.optim.SGD(wrapped.parameters(), lr=lr, momentum=0.9,
                                    weight_decay=1e-4)
        order = torch.Generator().manual_seed(seed)
        loader = DataLoader(train_set, batch_size, shuffle=True, generator=order)
        steps = epochs * len(loader)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, lr, total_steps=steps)
        for epoch in range(epochs):
            start = time.perf_counter()
            wrapped.train()
            seen = Meter()
            for images, masks in loader:
                out = s.forward_loss(wrapped, criterion, images.to(s.device), masks.to(s.device))
                optimizer.zero_grad(set_to_none=True)
                out.loss.backward()
                optimizer.step()
                schedule.step()
                seen.update(out.loss, out.correct, out.count, out.correct5, out.confusion)
            val = validate(s, wrapped, criterion, val_set, batch_size)
            if verbose:
                print(f"epoch {epoch + 1}/{epochs}: train loss {seen.loss:.4f} pixel acc "
                      f"{seen.acc:.2f}% | val loss {val.loss:.4f} pixel acc {val.acc:.2f}% "
                      f"mIoU {val.miou:.2f}% | {time.perf_counter() - start:.1f}s", flush=True)
    return {"loss": val.loss, "pixel_acc": val.acc, "miou": val.miou}


@torch.no_grad()
def validate(strategy, wrapped: nn.Module, criterion, dataset, batch_size: int) -> Meter:
    """Loss, pixel accuracy and mean IoU over ``dataset`` (one confusion matrix, summed)."""
    wrapped.eval()
    meter = Meter()
    for images, masks in DataLoader(dataset, batch_size):
        out = strategy.forward_loss(wrapped, criterion, images.to(strategy.device),
                                    masks.to(strategy.device))
        meter.update(out.loss, out.correct, out.count, out.correct5, out.confusion)
    return meter.reduced(strategy)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="balanced")
    parser.add_argument("--devices", default="cpu:3")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("-b", "--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--no-sync-bn", dest="sync_bn", action="store_false")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    final = train(args.strategy, args.devices, args.epochs, args.batch_size, args.lr,
                  args.sync_bn, args.seed)
    print(f"final: val loss {final['loss']:.4f} pixel acc {final['pixel_acc']:.2f}% "
          f"mIoU {final['miou']:.2f}%")
    return final


if __name__ == "__main__":
    main()
