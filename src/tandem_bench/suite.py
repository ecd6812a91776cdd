"""``run_bench``: build every contestant, race them, and return the whole report as a dict.

Every contestant gets a deep copy of one seeded template model and the same batch. In-process
contestants race first (:func:`~tandem_bench.runner.race`), then ``ddp``/``hybrid-ddp``/
``torch_ddp`` in a torchrun subprocess. The report's ``link`` is what the link costs a step
(:mod:`.link`): the bytes each process sends, planned, and the time they take at
``--link-rate`` and at the rate the torchrun phase measured. ``--variants`` twins (:mod:`~tandem_bench.variants`) race next to each
other; ``+compile`` twins compile in their warm-up step (``first_step_s``); ``--loop`` twins
(:mod:`~tandem_bench.loop_twin`) race next to their strategy contestant.
A skipped or failed contestant is reported with its reason and never stops the others.
"""

from __future__ import annotations

import copy
import datetime
import gc
import os
import platform
from typing import Callable

import torch
from torch import nn

from tandem import cpu_malloc
from tandem.distributed.env import Environment, malloc_left_alone
from tandem.config import flagged
from tandem.errors import first_line
from tandem.models import create_model
from tandem.strategies import strategy_class
from tandem.strategies.auto import wire_backend

from .baselines import bare_contestant, torch_dp_contestant, torch_dp_skip_reason
from .contestants import Contestant, skipped, synthetic_batch
from .distributed import distributed_phase
from .entry import Entry, lineup
from .link import plan_link
from .loop_twin import build_strategy
from .options import BenchConfig
from .runner import add_ratios, race
from .skips import strategy_skip_reason


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
                          failure=f"setup: {type(exc).__name__}: {first_line(flagged(exc))}")


def _strategy(entry: Entry, template: nn.Module, config: BenchConfig, batch) -> Contestant:
    """Strategy contestant ``entry`` on a copy of ``template``, or why it is skipped."""
    # A strategy that drives fewer devices gets only the first ones (it would warn otherwise).
    devices = config.device_list[:strategy_class(entry.base).max_devices]
    reason = strategy_skip_reason(entry.base, template, config.arch, entry.compiled,
                                  devices[0].type)
    if reason:
        return skipped(entry.name, "strategy", devices, reason)
    return _build(entry.name, "strategy", devices, lambda: build_strategy(
        entry, config, copy.deepcopy(template), devices, batch))


def _baseline(entry: Entry, template: nn.Module, config: BenchConfig, batch) -> Contestant:
    """In-process baseline ``entry`` (``bare`` or ``torch_dp``) on a copy of ``template``."""
    devices = config.device_list
    kw = dict(amp=entry.variant.precision(devices[0], config.amp_dtype), lr=config.lr,
              channels_last=entry.variant.channels_last)
    if entry.base == "bare":
        return _build(entry.name, "baseline", devices[:1], lambda: bare_contestant(
            copy.deepcopy(template), devices, batch, compiled=entry.compiled,
            compile_mode=config.compile_mode, **kw))
    reason = torch_dp_skip_reason(devices, entry.compiled)
    if reason:
        return skipped(entry.name, "baseline", devices, reason)
    return _build(entry.name, "baseline", devices, lambda: torch_dp_contestant(
        copy.deepcopy(template), devices, batch, **kw))


def _template(config: BenchConfig, model_fn: Callable[[], nn.Module] | None) -> nn.Module:
    """The seeded model every contestant copies: ``model_fn()``, else ``config.arch``'s."""
    if model_fn is None:

        def model_fn():
            return create_model(config.arch, num_classes=config.num_classes)

    torch.manual_seed(config.seed)
    return model_fn()


def _race_here(config: BenchConfig, entries: list[Entry], template: nn.Module) -> list[dict]:
    """Build ``entries`` (none multi-process) and race them interleaved in this process."""
    batch = synthetic_batch(config.batch_size, config.image_size, config.num_classes,
                            config.seed)
    local = [(_strategy if e.kind == "strategy" else _baseline)(e, template, config, batch)
             for e in entries]
    threads = f"{torch.get_num_threads()} torch threads"
    for contestant in local:
        contestant.notes.append(f"interleaved in one process ({threads})")
    try:
        return race(local, config.steps, config.warmup, config.batch_size)
    finally:
        for contestant in local:
            contestant.close()


def _free_memory(devices: list[torch.device]) -> None:
    """Free this process's models and cached device memory before torchrun workers need it."""
    gc.collect()
    if any(d.type == "cuda" for d in devices):
        torch.cuda.empty_cache()


def run_bench(config: BenchConfig, model_fn: Callable[[], nn.Module] | None = None) -> dict:
    """Race the strategies and baselines of ``config``; return ``{config, machine, results}``.

    ``config.threads`` sets torch's intra-op threads for the race; the caller's are restored
    after. Like a training run, it tunes glibc's malloc for the whole process
    (:mod:`tandem.cpu_malloc`). A custom ``model_fn`` cannot be sent to torchrun workers, so it
    skips ``ddp`` and ``torch_ddp``.
    """
    cpu_malloc.tune(malloc_left_alone(Environment.read()))  # as a training run: it keeps its peak
    previous = torch.get_num_threads()
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    try:
        return _run(config, model_fn)
    finally:
        torch.set_num_threads(previous)


def _run(config: BenchConfig, model_fn: Callable[[], nn.Module] | None) -> dict:
    devices = config.device_list
    machine = machine_info(devices)  # taken before the run: its date and load average
    template = _template(config, model_fn)
    if any(d.type == "cuda" for d in devices):
        torch.backends.cudnn.benchmark = config.cudnn_benchmark
    entries = lineup(config)
    link = plan_link(template, config.batch_size, config.processes(),
                     backend=wire_backend(devices[0]))  # what the wire carries (gloo on CPU)
    results = _race_here(config, [e for e in entries if not e.multiprocess], template)
    del template
    _free_memory(devices)
    remote = [e for e in entries if e.multiprocess]
    measured = None
    if remote:
        phase = distributed_phase(config, remote, custom_model=model_fn is not None)
        results += phase.results
        measured = phase.link_bytes_per_s
    order = [e.name for e in entries]
    results.sort(key=lambda r: order.index(r["name"]))
    return {"config": config.to_dict(), "machine": machine,
            "results": add_ratios(results, entries),
            "link": link.record(config.link_bytes_per_s(), measured)}
