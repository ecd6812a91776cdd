"""``tandem bench --data DIR -a ARCH``: the train loop fed by the loader, against each alone.

Three contestants share one model, optimizer, ImageFolder training split, batch and loader
workers, and are raced interleaved, a pass each per round (the order alternates):

- ``loader``: one pass over the training split's loader, batches only fetched (uint8, as the
  workers make them);
- ``step``: :meth:`~tandem.train.loop.Trainer.train_batch` and ``after_step`` on one batch
  already on the device, as many times as the pass has full batches (no loader, no copy);
- ``fed``: :meth:`~tandem.train.loop.Trainer.train_epoch`, the loop of ``tandem train``: the
  same loader, the copy and normalisation on the device, the step, progress and stop vote.

``loader`` and ``fed`` are rated after their start-up: the first wave of batches, one per
loader worker (the workers start together, so that wave arrives about at once and would
inflate a rate), at least one. ``loader`` is rated from the wave's last arrival, ``fed`` from
the end of its step (device synchronised), to the end of the pass, on the images after the
wave; the wave's seconds are reported apart as ``startup_seconds``. A pass must hold at least
two waves. A device is synchronised before each clock stop. ``fed / min(loader,
step)`` is the median over rounds of each round's ratio: 1.0 means the loop costs nothing
beyond its slower half. Beside the rates: ``fed``'s own data share (as ``tandem train`` shows
it) and every pass's CPU time per image, of this process and its workers (Linux), which tell a
loop that costs CPU from one that waits for cores (BENCHMARKS.md section 12).
"""

from __future__ import annotations

import statistics
from dataclasses import replace

import torch

from tandem.config import DataConfig
from tandem.distributed.env import Environment, cpu_bf16_override
from tandem.data import loader as loader_module
from tandem.data.device_decode import decode_on, decoded_on
from tandem.data.imagefolder import load_imagefolder
from tandem.data.loader import batches_per_epoch, make_loader
from tandem.errors import UsageError, param
from tandem.models import create_model
from tandem.precision import amp_precision
from tandem.strategies import strategy_names
from tandem.train.loop import Position

from .contestants import prepare_strategy
from .loader_bench import bench_root, cpu_seconds
from .loop_twin import loop_config, loop_trainer
from .suite import machine_info
from .timing import (IMPOSSIBLE, clock, impossible, impossible_lines, is_noise, noise_lines,
                     summarize, synchronize)

CONTESTANTS = ("loader", "step", "fed")


def _trainer(config, train, num_classes: int, workers: int):
    """A :class:`~tandem.train.loop.Trainer` of ``config`` (a :class:`~.config.BenchConfig`)
    on the dataset ``train``, built as the bench's ``/loop`` twins are (their optimizer, loss
    and constant schedule), and one device batch of ``train`` for ``step``."""
    device = config.device_list[0]
    precision = amp_precision(device.type, config.amp, config.amp_dtype,
                              cpu_bf16=cpu_bf16_override(Environment.read()))
    torch.manual_seed(config.seed)
    model = create_model(config.arch, num_classes=num_classes)
    batch = next(iter(make_loader(train, config.batch_size, shuffle=True, seed=config.seed,
                                  epoch=0)))
    one = strategy_names(reference=True)[0]  # the one-device strategy
    strategy, wrapped, _, _ = prepare_strategy(one, model, [device], batch,
                                               channels_last=config.channels_last)
    cfg = loop_config(one, config.arch, config.batch_size, precision, config.lr)
    cfg = replace(cfg, data=replace(DataConfig(), workers=workers),
                  parallel=replace(cfg.parallel, channels_last=config.channels_last))
    trainer = loop_trainer(cfg, strategy, wrapped, precision,
                           batches_per_epoch(train, config.batch_size), train_set=train)
    return trainer, trainer.device_batch(*batch)


def start_up_batches(workers: int) -> int:
    """The batches of a pass's start-up: one per loader worker, at least one."""
    return max(1, workers)


def _loader_pass(trainer, epoch: int, wave: int) -> tuple[float, float, int, int]:
    """Wall seconds, start-up seconds, images and start-up images of one pass over the
    trainer's own training loader (the fed pass's workers; with ``--decode gpu``, the device's
    decode too, synchronised before the clock is read); the start-up is the first ``wave``
    batches."""
    devices = trainer.strategy.devices
    loader = trainer.loader(trainer.train_set, train=True, epoch=epoch)
    images, first, first_images = 0, None, 0
    start = clock()
    for index, (batch, _) in enumerate(loader):
        images += batch.shape[0]
        if index == wave - 1:
            synchronize(devices)
            first, first_images = clock() - start, images
    synchronize(devices)
    wall = clock() - start
    return wall, wall if first is None else first, images, first_images


def _step_pass(trainer, batch, steps: int) -> tuple[float, float, int, int]:
    """Wall seconds of ``steps`` train steps on the device ``batch`` (nothing apart)."""
    devices = trainer.strategy.devices
    run = trainer.begin_epoch()
    synchronize(devices)
    start = clock()
    try:
        for index in range(steps):
            trainer.train_batch(run, index, *batch)
            trainer.after_step(run)
        synchronize(devices)
    finally:
        run.progress.close()
    return clock() - start, 0.0, steps * len(batch[1]), 0


def _fed_pass(trainer, epoch: int, wave: int) -> tuple[float, float, int, int]:
    """One epoch of the train loop from the start: wall seconds, start-up seconds (to the
    end of the ``wave``-th step, device synchronised), images and start-up images. Counted
    from the first batch's arrival instead, a step-bound pass would be rated on one step's
    images fewer than it ran."""
    devices = trainer.strategy.devices
    after_step, mark = trainer.after_step, {"steps": 0}

    def marking(run):
        stop = after_step(run)
        mark["steps"] += 1
        if mark["steps"] == wave:
            synchronize(devices)
            mark["at"], mark["images"] = clock(), run.meter.count
        return stop

    trainer.position = Position(epoch=epoch, step=trainer.position.step)
    trainer.after_step = marking
    try:
        synchronize(devices)
        start = clock()
        meter, _, _ = trainer.train_epoch()
        synchronize(devices)
        wall = clock() - start
    finally:
        del trainer.after_step  # the class's own again
    first = mark["at"] - start if "at" in mark else wall
    return wall, first, meter.count, mark.get("images", meter.count)


def _race(trainer, batch, rounds: int, warmup: int) -> dict[str, dict[str, list[float]]]:
    """Per contestant, each timed pass's images/s after its start-up (the first wave of
    batches) and the start-up's seconds; the order alternates round by round."""
    steps = max(1, len(trainer.train_set) // trainer.cfg.optim.batch_size)
    wave = start_up_batches(trainer.cfg.data.workers)
    passes = {"loader": lambda r: _loader_pass(trainer, r, wave),
              "step": lambda r: _step_pass(trainer, batch, steps),
              "fed": lambda r: _fed_pass(trainer, r, wave)}
    times = {name: {"rate": [], "startup": [], "data_share": [], "cpu_ms": []}
             for name in passes}
    for r in range(warmup + rounds):
        for name in (CONTESTANTS if r % 2 == 0 else CONTESTANTS[::-1]):
            cpu = cpu_seconds()
            wall, first, images, first_images = passes[name](r)
            cpu_end = cpu_seconds()
            if r >= warmup and cpu is not None and cpu_end is not None:
                times[name]["cpu_ms"].append(1000 * (cpu_end - cpu) / images)
            if r >= warmup and wall > first:
                times[name]["rate"].append((images - first_images) / (wall - first))
                times[name]["startup"].append(first)
                if name == "fed" and trainer.wait.share is not None:
                    times[name]["data_share"].append(trainer.wait.share)
    return times


def run_fed_bench(config, data: str, *, workers: int = 0, rounds: int = 3,
                  warmup: int = 1, decode: str = "cpu") -> dict:
    """Race ``loader``, ``step`` and ``fed`` (module doc) on ``data``'s training split with
    ``config`` (a :class:`~.config.BenchConfig`: arch, first device, batch, image size, amp,
    channels-last, lr, seed, threads); ``ratio`` is ``fed / min(loader, step)``. ``decode``
    is ``tandem train``'s ``--decode``: with gpu, ``loader`` and ``fed`` decode on the device."""
    root = bench_root(data, workers=(workers, 0), rounds=(rounds, 1), warmup=(warmup, 0))
    size = config.image_size
    train, _, info = load_imagefolder(root, augment="imagenet", image_size=size,
                                      splits=("train",))
    train = decode_on((train, None, info), decode, config.device_list[0])[0]
    batches, wave = batches_per_epoch(train, config.batch_size), start_up_batches(workers)
    if batches < 2 * wave:
        raise UsageError(
            f"{param('data')} '{data}': {len(train)} training images make {batches} batch(es) of "
            f"{config.batch_size}, too few to rate -j {workers}: a pass needs {2 * wave} at "
            f"least (its first {wave}, one per worker, are start-up); add images, or lower "
            "-b or -j")
    threads = torch.get_num_threads()
    if config.threads:
        torch.set_num_threads(config.threads)
    try:
        trainer, batch = _trainer(config, train, info.num_classes, workers)
        used_threads = torch.get_num_threads()
        try:
            times = _race(trainer, batch, rounds, warmup)
        finally:
            del trainer.loaders  # shuts the persistent workers down
            trainer.strategy.close()
    finally:
        torch.set_num_threads(threads)
    results = [{"name": name, "images": len(train),
                "images_per_sec": summarize(times[name]["rate"]).as_dict(),
                "startup_seconds": (statistics.median(times[name]["startup"])
                                    if name != "step" else None),
                # fed: the loop's wait for data after the first batch, as `tandem train`
                # shows it (tandem.train.datawait)
                "data_share": _median(times[name]["data_share"]),
                # CPU time of this process and the loader workers per image, whole pass
                "cpu_ms_per_image": _median(times[name]["cpu_ms"])}
               for name in CONTESTANTS]
    rates = {name: times[name]["rate"] for name in CONTESTANTS}
    ratios = {"fed_vs_min": _median([f / min(a, b) for f, a, b in
                                     zip(rates["fed"], rates["loader"], rates["step"])]),
              "fed_vs_loader": _median([f / a for f, a in zip(rates["fed"], rates["loader"])]),
              "fed_vs_step": _median([f / b for f, b in zip(rates["fed"], rates["step"])])}
    slower = min(("loader", "step"), key=lambda n: statistics.median(rates[n]))
    settings = {"data": str(root), "arch": config.arch, "device": str(config.device_list[0]),
                "image_size": size, "batch_size": config.batch_size, "workers": workers,
                "decode": decoded_on(train),
                "prefetch": loader_module.PREFETCH, "rounds": rounds, "warmup": warmup,
                "seed": config.seed, "amp": config.amp, "amp_dtype": config.amp_dtype,
                "channels_last": config.channels_last, "torch_threads": used_threads}
    return {"config": settings, "machine": machine_info(list(trainer.strategy.devices)),
            "results": results, "limit": slower, "ratio": ratios["fed_vs_min"], **ratios}


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def format_fed_table(report: dict) -> str:
    """The human-readable table of :func:`run_fed_bench`'s report."""
    c, m = report["config"], report["machine"]
    lines = [f"tandem bench --data -a {c['arch']}: {c['data']}, {report['results'][0]['images']} "
             f"images, {c['image_size']}x{c['image_size']}, batch {c['batch_size']}, "
             f"-j {c['workers']}, decode on the {c['decode']}, {c['device']}, "
             f"{c['torch_threads']} torch threads, "
             f"{c['rounds']} timed passes after {c['warmup']} warm-up; torch {m['torch']}, "
             f"{m['cpu_count']} CPUs, {m['date_utc']}",
             f"{'contestant':<11} {'img/s':>8} {'IQR':>7} {'min..max':>15} {'start-up s':>10} "
             f"{'data wait':>9} {'CPU ms/img':>10}"]
    for r in report["results"]:
        s, up, share, cpu = (r["images_per_sec"], r["startup_seconds"], r["data_share"],
                             r["cpu_ms_per_image"])
        name = r["name"] + (" !" if is_noise(s) else "")
        lines.append(f"{name:<11} {s['median']:8.1f} {s['iqr']:7.1f} "
                     f"{s['min']:7.1f}..{s['max']:<7.1f} "
                     f"{'-' if up is None else f'{up:.3f}':>10} "
                     f"{'-' if share is None else f'{share:.0%}':>9} "
                     f"{'-' if cpu is None else f'{cpu:.2f}':>10}")
    # fed runs the loader and the step: its rate over either's cannot be above 1
    claims = [f"fed {report[key]:.2f}x its own {part}" for part, key in
              (("loader", "fed_vs_loader"), ("step", "fed_vs_step"))
              if report[key] is not None and impossible(1 / report[key])]
    mark = {key: f" {IMPOSSIBLE}" if report[key] is not None and impossible(1 / report[key])
            else "" for key in ("ratio", "fed_vs_loader", "fed_vs_step")}
    lines.append(f"fed / min(loader, step): {report['ratio']:.2f}x{mark['ratio']} (the "
                 f"{report['limit']} is the limit; fed / loader {report['fed_vs_loader']:.2f}x"
                 f"{mark['fed_vs_loader']}, fed / step {report['fed_vs_step']:.2f}x"
                 f"{mark['fed_vs_step']}; medians of the rounds' ratios, rates after "
                 f"each pass's start-up, its first {start_up_batches(c['workers'])} "
                 f"batch(es), one per worker)")
    lines += noise_lines([(r["name"], r["images_per_sec"]) for r in report["results"]])
    lines += impossible_lines(claims)
    return "\n".join(lines)
