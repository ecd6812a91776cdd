"""``run_bench``: build every contestant, race them, and return the whole report as a dict.

Every contestant gets a deep copy of one seeded template model and the same batch. In-process
contestants race first (:func:`~tandem.bench.runner.race`), then ``ddp``/``torch_ddp`` in a
torchrun subprocess. ``--variants`` twins (:mod:`~tandem.bench.variants`) race next to each
other; ``+compile`` twins compile in their warm-up step (``first_step_s``); ``--loop`` twins
(:mod:`~tandem.bench.loop`) race next to their strategy contestant.
A skipped or failed contestant is reported with its reason and never stops the others.
"""

from __future__ import annotations

import copy
import datetime
import gc
import importlib
import os
import platform
from typing import Callable

import torch
from torch import nn

from tandem.errors import first_line
from tandem.strategies import strategy_class

from .baselines import bare_contestant, torch_dp_contestant, torch_dp_skip_reason
from .config import BenchConfig
from .contestants import COMPILED, SPLITS, Contestant, skipped, split_of, synthetic_batch
from .loop import LOOP, builder
from .runner import add_ratios, race
from .variants import Variant, variants_of

__all__ = ["run_bench", "machine_info", "registered_strategies", "strategy_skip_reason",
           "result_order"]


def registered_strategies() -> list[str]:
    """Names in tandem's strategy registry (importing ``tandem.strategies`` registers them)."""
    importlib.import_module("tandem.strategies")
    from tandem.strategies.base import strategy_names

    return strategy_names()


def strategy_skip_reason(name: str, model: nn.Module, arch: str, compiled: bool = False,
                         device_type: str = "cpu") -> str | None:
    """Why tandem strategy ``name`` (compiled if ``compiled``) cannot run with ``model``."""
    if name not in registered_strategies():
        return f"strategy {name!r} is not available (not registered in tandem.strategies)"
    problem = None if model is None else strategy_class(name).check_model(model)
    if problem:
        return f"{arch}: {name} {problem}"
    if compiled:
        from tandem.strategies.compile import compile_skip_reason

        return compile_skip_reason(name, device_type)
    return None


def machine_info(devices: list[torch.device]) -> dict:
    """Where and when the numbers were taken."""
    info = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "accelerators": [],
    }
    for device in dict.fromkeys(d for d in devices if d.type == "cuda"):
        props = torch.cuda.get_device_properties(device)
        info["accelerators"].append(
            {"device": str(device), "name": props.name, "memory_bytes": props.total_memory})
    return info


def _build(name: str, kind: str, devices, build: Callable[[], Contestant]) -> Contestant:
    """``build()`` named ``name``, or a ``failed`` contestant carrying the error: a broken
    setup is a result to report, not a reason to stop the other contestants."""
    try:
        contestant = build()
        contestant.name = name  # with its variant's suffix
        return contestant
    except Exception as exc:
        return Contestant(name=name, kind=kind, devices=list(devices),
                          failure=f"setup: {type(exc).__name__}: {first_line(exc)}")


def split_names(config: BenchConfig, name: str) -> list[str]:
    """``name``, and with ``--handicap`` its ``/auto`` and ``/ideal`` variants when it splits
    the batch (a model it must split itself, such as hybrid's, is raced as it is)."""
    cls = strategy_class(name)
    if config.handicap is None or not cls.splits_batch or not cls.takes_any_model():
        return [name]
    return [name + kind for kind in SPLITS]


def _strategy(label: str, template: nn.Module, config: BenchConfig, batch,
              variant: Variant, compiled: bool = False, loop: bool = False) -> Contestant:
    """Strategy contestant ``label`` ("dp", "dp/auto", ...) in ``variant``, maybe compiled;
    with ``loop`` its ``/loop`` twin (:mod:`.loop`)."""
    name, split = split_of(label, config.ideal_split())
    # A strategy that drives fewer devices gets only the first ones (it would warn otherwise).
    devices = config.device_list[:strategy_class(name).max_devices]
    reason = strategy_skip_reason(name, template, config.arch, compiled, devices[0].type)
    label = label + variant.suffix + (COMPILED if compiled else "") + (LOOP if loop else "")
    if reason:
        return skipped(label, "strategy", devices, reason)
    handicap = config.handicap_spec() if split_names(config, name) != [name] else None
    return _build(label, "strategy", devices, lambda: builder(loop, config)(
        name, copy.deepcopy(template), devices, batch,
        amp=variant.precision(devices[0], config.amp_dtype), lr=config.lr,
        channels_last=variant.channels_last, sync_bn=config.sync_bn, buffers=config.buffers,
        compiled=compiled, compile_mode=config.compile_mode, split=split, handicap=handicap))


def _twins(config: BenchConfig) -> list[tuple[Variant, bool]]:
    """Every (variant, compiled) pair to race, each compiled twin right after its original."""
    return [(v, c) for v in variants_of(config) for c in ((False, True) if config.compile
                                                          else (False,))]


def _loops(config: BenchConfig) -> tuple[bool, ...]:
    """A strategy contestant, then with ``--loop`` its loop twin."""
    return (False, True) if config.loop else (False,)


def result_order(config: BenchConfig) -> list[str]:
    """Every contestant's name in table order: per contestant (and split), its variants and
    their compiled twins, a strategy's each followed by its loop twin."""
    strategies = [n for s in config.strategies for n in split_names(config, s)]
    return [n + v.suffix + (COMPILED if c else "") + (LOOP if loop else "")
            for n in ["bare", *strategies, "torch_dp", "torch_ddp"]
            for v, c in _twins(config)
            for loop in (_loops(config) if n in strategies else (False,))]


def run_bench(config: BenchConfig, model_fn: Callable[[], nn.Module] | None = None) -> dict:
    """Race the strategies and baselines of ``config``; return ``{config, machine, results}``.

    A custom ``model_fn`` cannot be sent to torchrun workers, so it skips ``ddp`` and ``torch_ddp``.
    """
    from .distributed import distributed_phase

    devices = config.device_list
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    machine = machine_info(devices)  # taken before the run: its date and load average
    if model_fn is None:
        from tandem.models import create_model

        def model_fn():
            return create_model(config.arch, num_classes=config.num_classes)

        custom = False
    else:
        custom = True
    torch.manual_seed(config.seed)
    template = model_fn()
    batch = synthetic_batch(config.batch_size, config.image_size, config.num_classes,
                            config.seed)

    def kw(variant: Variant) -> dict:
        return dict(amp=variant.precision(devices[0], config.amp_dtype), lr=config.lr,
                    channels_last=variant.channels_last)

    if any(d.type == "cuda" for d in devices):
        torch.backends.cudnn.benchmark = config.cudnn_benchmark

    local: list[Contestant] = []
    twins = _twins(config)
    for v, c in twins if "bare" in config.baselines else ():
        local.append(_build("bare" + v.suffix + COMPILED * c, "baseline", devices[:1],
                            lambda v=v, c=c: bare_contestant(
                                copy.deepcopy(template), devices, batch, compiled=c,
                                compile_mode=config.compile_mode, **kw(v))))
    for name in config.strategies:
        if not strategy_class(name).multiprocess:
            local += [_strategy(label, template, config, batch, v, c, loop)
                      for label in split_names(config, name) for v, c in twins
                      for loop in _loops(config)]
    for v, c in twins if "torch_dp" in config.baselines else ():
        reason = torch_dp_skip_reason(devices, c)
        label = "torch_dp" + v.suffix + COMPILED * c
        local.append(skipped(label, "baseline", devices, reason) if reason else _build(
            label, "baseline", devices, lambda v=v: torch_dp_contestant(
                copy.deepcopy(template), devices, batch, **kw(v))))
    threads = f"{torch.get_num_threads()} torch threads"
    for contestant in local:
        contestant.notes.append(f"interleaved in one process ({threads})")
    try:
        results = race(local, config.steps, config.warmup, config.batch_size)
    finally:
        for contestant in local:
            contestant.close()
    # Free this process's models and cached device memory before torchrun workers need it.
    del local, template
    gc.collect()
    if any(d.type == "cuda" for d in devices):
        torch.cuda.empty_cache()

    remote = [label + v.suffix + COMPILED * c + LOOP * loop
              for n in config.strategies if strategy_class(n).multiprocess
              for label in split_names(config, n) for v, c in twins for loop in _loops(config)]
    if "torch_ddp" in config.baselines:
        remote += ["torch_ddp" + v.suffix + COMPILED * c for v, c in twins]
    if remote:
        results += distributed_phase(config, remote, custom_model=custom)
    order = result_order(config)
    results.sort(key=lambda r: order.index(r["name"]))
    return {"config": config.to_dict(), "machine": machine,
            "results": add_ratios(results)}
