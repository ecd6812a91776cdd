"""``tandem bench --data DIR``: the input pipeline alone, next to a torchvision-style reference.

All read the ImageFolder's training split with the same sampler, workers and crop boxes.
``loader`` is tandem's pipeline (uint8 batches; normalising belongs to the device step and is
not timed), with simplejpeg decoding the JPEGs when it is installed; ``loader-pillow`` is the same
pipeline with Pillow's decoder (raced only when the two differ); ``reference`` does what torchvision's ``RandomResizedCrop``/``ToTensor``/``Normalize``
do, in Pillow and torch. Reported per wall-second and per CPU-second (``/proc``, Linux only);
rounds alternate the order so load from other processes hits both alike. A file that does not
decode is warned about and replaced by the next one in every pipeline alike, reference included
(:func:`~tandem.data.imagefolder.first_decodable`).
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from tandem.data.dataset import split_key
from tandem.data.decode import decoding, default_decoder
from tandem.data.imagefolder import (MEAN, STD, ImageFolderDataset, first_decodable,
                                     load_imagefolder)
from tandem.data.imagenet_transforms import random_resized_box
from tandem.data.loader import make_loader
from tandem.data.transforms import SampleRandom
from tandem.errors import MissingFileError, UsageError, param

from .suite import machine_info
from .timing import clock, is_noise, noise_lines, summarize


class ReferenceDataset(torch.utils.data.Dataset):
    """The torchvision-style training transform on ``(path, label)`` samples (see module doc)."""

    def __init__(self, samples: list[tuple[str, int]], image_size: int):
        self.samples, self.image_size = samples, image_size
        self.shape = (3, image_size, image_size)
        self._bad: set[int] = set()  # files that did not decode, as in ImageFolderDataset

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, key) -> tuple[torch.Tensor, int]:
        index, seed, epoch = split_key(key)
        # the draws of the sample asked for, also for a substitute (as tandem's loader does)
        return first_decodable(self.samples, self._bad, index,
                               lambda i: self._transform(i, SampleRandom(seed, epoch, index)))

    def _transform(self, i: int, rng: SampleRandom) -> torch.Tensor:
        path = self.samples[i][0]
        with decoding(path), open(path, "rb") as f:  # torchvision's pil_loader
            img = Image.open(f).convert("RGB")
        box = random_resized_box(img.width, img.height, rng)
        flip = rng.coin()
        size = self.image_size
        img = img.resize((size, size), Image.BILINEAR, box=box)
        if flip:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        # ToTensor: a writable copy, channels first, float in [0, 1]
        tensor = torch.from_numpy(np.array(img, copy=True)).permute(2, 0, 1).contiguous()
        tensor = tensor.float().div(255)
        # Normalize (inplace=False): a clone, then per-channel mean and std made per call
        tensor = tensor.clone()
        mean = torch.as_tensor(MEAN, dtype=tensor.dtype).view(-1, 1, 1)
        std = torch.as_tensor(STD, dtype=tensor.dtype).view(-1, 1, 1)
        return tensor.sub_(mean).div_(std)


def cpu_seconds() -> float | None:
    """CPU seconds used so far by this process and its live children (Linux), else None."""
    total = time.process_time()
    for child in multiprocessing.active_children():  # DataLoader workers
        try:
            with open(f"/proc/{child.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return None
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime+stime
    return total


def _pass(loader) -> tuple[float, float | None, int]:
    """Wall seconds, CPU seconds (or None) and images of one full pass over ``loader``."""
    images = 0
    cpu, start = cpu_seconds(), clock()
    for batch, _ in loader:
        images += batch.shape[0]
    wall, cpu_end = clock() - start, cpu_seconds()
    return wall, (None if cpu is None or cpu_end is None else cpu_end - cpu), images


def bench_root(data: str, **counts: tuple[int, int]) -> Path:
    """``data`` as a directory, once each ``name=(value, least)`` is an int of at least
    ``least``; else one line naming the argument or the directory."""
    for name, (value, least) in counts.items():
        if not isinstance(value, int) or value < least:
            raise UsageError(f"bad {name} {value!r}: must be an int >= {least}")
    root = Path(data).expanduser()
    if not root.is_dir():
        raise MissingFileError(f"{param('data')} '{data}' is not a directory")
    return root


def run_loader_bench(data: str, *, image_size: int = 224, workers: int = 0,
                     batch_size: int = 64, rounds: int = 5, warmup: int = 1,
                     seed: int = 0) -> dict:
    """Time the pipelines on ``data``'s training split; ``results`` holds loader,
    loader-pillow (when simplejpeg is installed) and reference, each with its ratios to the
    reference; the top-level ratios are the loader's."""
    root = bench_root(data, image_size=(image_size, 1), workers=(workers, 0),
                      batch_size=(batch_size, 1), rounds=(rounds, 1), warmup=(warmup, 0))
    train, _, _ = load_imagefolder(root, augment="imagenet", image_size=image_size)
    contestants = {"loader": train}
    if default_decoder() != "pillow":
        contestants["loader-pillow"] = ImageFolderDataset(train.samples, image_size=image_size,
                                                          augment="imagenet", decoder="pillow")
    contestants["reference"] = ReferenceDataset(train.samples, image_size)
    machine = machine_info([torch.device("cpu")])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = _race(contestants, batch_size, workers, rounds, warmup, seed)
    finally:
        torch.set_num_threads(threads)
    results = []
    for name, ds in contestants.items():
        ips = summarize(times[name]["wall"]).as_dict()
        cpu = times[name]["cpu"]
        results.append({"name": name, "images": len(train), "images_per_sec": ips,
                        "images_per_sec_per_core": ips["median"] / max(1, workers),
                        "images_per_cpu_sec": summarize(cpu).as_dict() if cpu else None,
                        "batch_dtype": str(getattr(ds, "dtype", torch.float32))[6:],
                        "decoder": ("pillow" if name == "reference"
                                    else ds.decoder or default_decoder()),
                        "ratio_vs_reference": _paired_ratio(times[name]["wall"],
                                                            times["reference"]["wall"]),
                        "cpu_ratio_vs_reference": _paired_ratio(times[name]["cpu"],
                                                                times["reference"]["cpu"])})
    ratio, cpu_ratio = results[0]["ratio_vs_reference"], results[0]["cpu_ratio_vs_reference"]
    config = {"data": str(root), "image_size": image_size, "workers": workers,
              "batch_size": batch_size, "rounds": rounds, "warmup": warmup, "seed": seed,
              "torch_threads": 1}
    return {"config": config, "machine": machine, "results": results,
            "ratio_loader_vs_reference": ratio, "cpu_ratio_loader_vs_reference": cpu_ratio}


def _paired_ratio(ours: list[float], theirs: list[float]) -> float | None:
    """Median over rounds of ``ours / theirs``: each ratio compares two passes that ran side
    by side, so it is steadier under load than a ratio of two medians."""
    if not ours or len(ours) != len(theirs):
        return None
    return statistics.median(a / b for a, b in zip(ours, theirs))


def _race(contestants: dict, batch_size: int, workers: int, rounds: int, warmup: int,
          seed: int) -> dict[str, dict[str, list[float]]]:
    """Images per wall- and per CPU-second of every timed pass, per contestant, interleaved."""
    loaders = {name: make_loader(ds, batch_size, shuffle=True, seed=seed, epoch=0,
                                 workers=workers, persistent=True)
               for name, ds in contestants.items()}
    times = {name: {"wall": [], "cpu": []} for name in loaders}
    names = list(loaders)
    for r in range(warmup + rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            loaders[name].batch_sampler.set_position(epoch=r)
            wall, cpu, images = _pass(loaders[name])
            if r >= warmup:
                times[name]["wall"].append(images / wall)
                if cpu:  # None off Linux; 0 when a pass is shorter than a clock tick
                    times[name]["cpu"].append(images / cpu)
    del loaders  # shuts the persistent workers down
    return times


def format_loader_table(report: dict) -> str:
    """The human-readable table of :func:`run_loader_bench`'s report."""
    c, m = report["config"], report["machine"]
    lines = [f"tandem bench --data: {c['data']}, {report['results'][0]['images']} images, "
             f"{c['image_size']}x{c['image_size']}, batch {c['batch_size']}, "
             f"-j {c['workers']}, {c['rounds']} timed passes after {c['warmup']} warm-up; "
             f"torch {m['torch']}, {m['cpu_count']} CPUs, {m['date_utc']}",
             f"{'pipeline':<13} {'decoder':<10} {'img/s':>8} {'IQR':>7} {'min..max':>15} "
             f"{'img/s/core':>10} {'img/CPU-s':>9} {'/ref wall':>9} {'/ref CPU':>8}"]
    for r in report["results"]:
        s, cpu = r["images_per_sec"], r["images_per_cpu_sec"]
        ratios = (r["ratio_vs_reference"], r["cpu_ratio_vs_reference"])
        name = r["name"] + (" !" if is_noise(s) else "")
        lines.append(f"{name:<13} {r['decoder']:<10} {s['median']:8.1f} {s['iqr']:7.1f} "
                     f"{s['min']:7.1f}..{s['max']:<7.1f} {r['images_per_sec_per_core']:10.1f} "
                     f"{cpu['median'] if cpu else float('nan'):9.1f} "
                     + " ".join(f"{'n/a' if x is None else f'{x:.2f}x':>{w}}"
                                for x, w in zip(ratios, (9, 8))))
    cpu_ratio = report["cpu_ratio_loader_vs_reference"]
    lines.append(f"loader / reference: {report['ratio_loader_vs_reference']:.2f}x img/s, "
                 f"{'n/a' if cpu_ratio is None else f'{cpu_ratio:.2f}x'} img per CPU-second "
                 f"(median of the rounds' ratios; loader batches are uint8, normalised later "
                 f"on the device)")
    lines += noise_lines([(r["name"], r["images_per_sec"]) for r in report["results"]])
    return "\n".join(lines)
