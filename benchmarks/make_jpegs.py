"""Write an ImageFolder tree of generated, real-size JPEGs for the input-pipeline benchmark.

Nothing is downloaded. Each image is 500x375 (ImageNet's most common size), saved at JPEG
quality 90 with 4:2:0 chroma, like most photos. Its content mixes smooth colour fields,
random shapes with hard edges and fine-grained texture, so that it compresses to about the
size of an average ImageNet JPEG (about 100 KB) and decodes at a realistic cost: a flat image
would decode unrealistically fast, pure noise unrealistically slowly. Each image is drawn
from its own generator, seeded by (seed, class, index), so the tree is the same whichever
number of processes (``--jobs``, default: every core) writes it.

    python benchmarks/make_jpegs.py runs/jpegs --classes 4 --per-class 64
    tandem bench --data runs/jpegs -j 1
"""

from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ProcessPoolExecutor

import numpy as np
from PIL import Image, ImageDraw

__all__ = ["make_image", "write_tree", "main"]

WIDTH, HEIGHT, QUALITY = 500, 375, 90


def make_image(rng: np.random.Generator, width: int = WIDTH, height: int = HEIGHT) -> Image.Image:
    """One photo-like RGB image: low-frequency colour, shapes, then texture noise."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.zeros((height, width, 3), np.float32)
    for _ in range(4):  # a few smooth sinusoidal colour fields
        fx, fy = rng.uniform(0.002, 0.02, size=2)
        phase = rng.uniform(0, 2 * np.pi)
        wave = np.sin(2 * np.pi * (fx * x + fy * y) + phase)
        base += wave[..., None] * rng.uniform(-50, 50, size=3)
    base += rng.uniform(60, 190, size=3)
    img = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(6, 14))):  # objects with hard edges
        x0, y0 = rng.uniform(-50, width), rng.uniform(-50, height)
        w, h = rng.uniform(20, 200, size=2)
        box = [x0, y0, x0 + w, y0 + h]
        colour = tuple(int(c) for c in rng.integers(0, 256, size=3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=colour)
    arr = np.asarray(img, dtype=np.float32)
    arr += rng.normal(0, rng.uniform(12, 28), size=arr.shape)  # texture, sensor noise
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))


def _write_one(root: str, seed: int, c: int, i: int) -> None:
    image = make_image(np.random.default_rng([seed, c, i]))
    image.save(os.path.join(root, f"class{c}", f"{i:05d}.jpg"), quality=QUALITY,
               subsampling="4:2:0")


def write_tree(root: str, classes: int, per_class: int, seed: int = 0,
               jobs: int | None = None) -> int:
    """Write ``root/class{c}/{i}.jpg`` with ``jobs`` processes (default: every core);
    returns the number of files written."""
    for c in range(classes):
        os.makedirs(os.path.join(root, f"class{c}"), exist_ok=True)
    todo = [(root, seed, c, i) for c in range(classes) for i in range(per_class)]
    jobs = min(jobs or os.cpu_count() or 1, len(todo))
    if jobs <= 1:
        for args in todo:
            _write_one(*args)
    else:
        with ProcessPoolExecutor(jobs) as pool:
            list(pool.map(_write_one, *zip(*todo), chunksize=8))
    return len(todo)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="directory to create (class subdirectories go inside)")
    p.add_argument("--classes", type=int, default=4)
    p.add_argument("--per-class", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=None, help="processes (default: every core)")
    args = p.parse_args(argv)
    n = write_tree(args.out, args.classes, args.per_class, args.seed, args.jobs)
    print(f"wrote {n} JPEGs of {WIDTH}x{HEIGHT} (quality {QUALITY}) under {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
