"""The two stages of a training crop, way by way, side by side: JPEG decode, then resample.

Every way decodes the same files for the same RandomResizedCrop boxes (``SampleRandom(seed, 0,
i)``), in interleaved rounds (the order flips each round), timed in this thread's CPU time.
Each row gives the median over rounds of ms per image, its ratio to Pillow's, and how far the
finished crops (decode, then tandem's resample) are from the crops of Pillow's decode.

    python benchmarks/make_jpegs.py runs/bench/jpegs --classes 4 --per-class 64
    python benchmarks/jpeg_decoders.py runs/bench/jpegs --image-size 224 --rounds 7

Decode ways: Pillow (with ``draft``) and simplejpeg, which tandem uses; simplejpeg with
libjpeg-turbo's faster, less exact IDCT and chroma upsampling; simplejpeg at the smallest N/8
DCT scale that keeps the box at least the output (not only 1/2, 1/4, 1/8); and simplejpeg told
the image ends a little below the box (the frame header's height cut, so libjpeg stops there:
baseline files only, and it must run non-strict, so a truncated file no longer raises).
Resample ways: Pillow's ``resize(box=...)`` and tandem's torch crop + resize.
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import statistics
import struct
import sys
import time

import numpy as np
import simplejpeg
import torch
from PIL import Image

from tandem_bench import write_json
from tandem.data.decode import PillowImage, SimpleJpegImage, reduction
from tandem.data.imagenet_transforms import random_resized_box, resized_crop
from tandem.data.transforms import SampleRandom

__all__ = ["DECODE_WAYS", "RESAMPLE_WAYS", "measure", "main"]


def _header(data):
    height, width, _, _ = simplejpeg.decode_jpeg_header(data)
    return width, height


def _pillow(data, box, size):
    img = PillowImage(data, "<bench>")
    return img.decode(box, size, size)


def _simplejpeg(data, box, size, **kw):
    if not kw:
        width, height = _header(data)
        return SimpleJpegImage(data, height, width).decode(box, size, size)
    width, height = _header(data)
    k = reduction(width, height, box, size, size)
    arr = simplejpeg.decode_jpeg(data, min_width=math.ceil(width / k),
                                 min_height=math.ceil(height / k), **kw)
    return arr, k  # the DCT divisor, on both axes (tandem.data.decode's module doc)


def _any_scale(data, box, size):
    width, height = _header(data)
    bw, bh = box[2] - box[0], box[3] - box[1]
    min_w, min_h = math.ceil(width * size / bw), math.ceil(height * size / bh)
    arr = simplejpeg.decode_jpeg(data, min_width=min_w, min_height=min_h)
    # the smallest N/8 scale giving at least those sizes (simplejpeg never scales up): 8 / N
    n = next((n for n in range(1, 8) if math.ceil(width * n / 8) >= min_w
              and math.ceil(height * n / 8) >= min_h), 8)
    assert arr.shape[:2] == (math.ceil(height * n / 8), math.ceil(width * n / 8))
    return arr, 8 / n


def _baseline_sof(data: bytes) -> int | None:
    """Offset of a baseline/extended sequential frame header (SOF0/SOF1), else None."""
    i = 2
    while i + 4 <= len(data) and data[i] == 0xFF:
        marker = data[i + 1]
        if marker in (0xC0, 0xC1):
            return i
        if 0xC2 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC) or marker == 0xDA:
            return None  # progressive, lossless, arithmetic, or scan before a frame
        i += 2 + struct.unpack(">H", data[i + 2:i + 4])[0]
    return None


def _rows_to_box(data, box, size):
    """Full scale, rows down to the box's bottom plus one 16-row MCU band (so the upsampled
    chroma of the last needed row has its neighbour); then the box is inside what decoded."""
    width, height = _header(data)
    cut = min(height, (box[3] // 16 + 2) * 16)
    at = _baseline_sof(data)
    if at is None or reduction(width, height, box, size, size) > 1 or cut >= height:
        return _simplejpeg(data, box, size)
    data = data[:at + 5] + struct.pack(">H", cut) + data[at + 7:]
    return simplejpeg.decode_jpeg(data, strict=False), 1.0  # strict: "extraneous bytes"


DECODE_WAYS = {
    "pillow (draft)": _pillow,
    "simplejpeg": _simplejpeg,
    "simplejpeg fastdct": lambda d, b, s: _simplejpeg(d, b, s, fastdct=True),
    "simplejpeg fastdct+fastupsample": lambda d, b, s: _simplejpeg(d, b, s, fastdct=True,
                                                                   fastupsample=True),
    "simplejpeg any N/8 scale": _any_scale,
    "simplejpeg rows to the box": _rows_to_box,
}


def _pillow_resample(image, box, scale, size):
    out = Image.fromarray(image).resize((size, size), Image.BILINEAR,
                                        box=tuple(c / scale for c in box))
    return np.array(out)


RESAMPLE_WAYS = {
    "pillow resize(box=...)": _pillow_resample,
    "torch crop + resize": lambda image, box, scale, size: resized_crop(image, box, scale,
                                                                        size, False),
}


def _rounds(ways: dict, run_one, n: int, rounds: int) -> dict[str, list[float]]:
    """ms per image of each way per round; the ways' order flips every round."""
    names, times = list(ways), {name: [] for name in ways}
    for r in range(rounds + 1):  # round 0 warms up
        for name in names if r % 2 == 0 else names[::-1]:
            start = time.thread_time()
            for i in range(n):
                run_one(ways[name], i)
            if r:
                times[name].append((time.thread_time() - start) / n * 1e3)
    return times


def measure(data_dir: str, image_size: int = 224, rounds: int = 7, seed: int = 0,
            limit: int | None = None) -> dict:
    files = sorted(glob.glob(os.path.join(data_dir, "**", "*.jp*g"), recursive=True))[:limit]
    blobs = [open(f, "rb").read() for f in files]
    boxes = [random_resized_box(*_header(d), SampleRandom(seed, 0, i))
             for i, d in enumerate(blobs)]
    base, diffs, scales = None, {}, {}
    for name, way in DECODE_WAYS.items():  # one way's arrays at a time: a few MB, not a GB
        out = [way(d, b, image_size) for d, b in zip(blobs, boxes)]
        crops = [resized_crop(a, b, s, image_size, False).astype(np.int16)
                 for (a, s), b in zip(out, boxes)]
        base = crops if base is None else base  # the first way, Pillow's
        diffs[name] = [np.abs(c - r) for c, r in zip(crops, base)]
        scales[name] = [s for _, s in out]
    size = image_size
    decode_t = _rounds(DECODE_WAYS, lambda way, i: way(blobs[i], boxes[i], size),
                       len(blobs), rounds)
    ref = [_simplejpeg(d, b, size) for d, b in zip(blobs, boxes)]
    resample_t = _rounds(RESAMPLE_WAYS,
                         lambda way, i: way(ref[i][0], boxes[i], ref[i][1], size),
                         len(blobs), rounds)
    rows = []
    for stage, times, first in (("decode", decode_t, "pillow (draft)"),
                                ("resample", resample_t, "pillow resize(box=...)")):
        for name, ms in times.items():
            row = {"stage": stage, "way": name, "ms_per_image": statistics.median(ms),
                   "vs_first": statistics.median(a / b for a, b in zip(times[first], ms))}
            if stage == "decode":
                row["crop_diff_mean"] = float(np.mean([d.mean() for d in diffs[name]]))
                row["crop_diff_max"] = int(max(d.max() for d in diffs[name]))
                row["reduced_scale_share"] = sum(s > 1 for s in scales[name]) / len(blobs)
            rows.append(row)
    return {"config": {"data": data_dir, "images": len(blobs), "image_size": image_size,
                       "rounds": rounds, "seed": seed, "torch_threads": torch.get_num_threads(),
                       "simplejpeg": simplejpeg.__version__, "pillow": Image.__version__},
            "rows": rows}


def format_rows(report: dict) -> str:
    c = report["config"]
    lines = [f"{c['images']} JPEGs of {c['data']}, crops to {c['image_size']} px, median of "
             f"{c['rounds']} interleaved rounds, thread CPU time; simplejpeg {c['simplejpeg']}, "
             f"Pillow {c['pillow']}",
             f"{'stage':<9}{'way':<33}{'ms/img':>7}{'speed vs first':>15}{'crop diff mean/max':>20}"
             f"{'reduced':>8}"]
    for r in report["rows"]:
        diff = (f"{r['crop_diff_mean']:.3f} / {r['crop_diff_max']}" if "crop_diff_mean" in r
                else "")
        red = f"{r['reduced_scale_share']:.0%}" if "reduced_scale_share" in r else ""
        lines.append(f"{r['stage']:<9}{r['way']:<33}{r['ms_per_image']:7.3f}"
                     f"{r['vs_first']:14.2f}x{diff:>20}{red:>8}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data", help="a directory of JPEGs (searched recursively)")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, default=None, help="use only the first N files")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    report = measure(args.data, args.image_size, args.rounds, args.seed, args.limit)
    print(format_rows(report))
    if args.json:
        write_json(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
