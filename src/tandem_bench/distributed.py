"""The torchrun phase: ``ddp``, ``hybrid-ddp`` and ``torch_ddp`` (and twins, ``ddp/loop`` too),
one process per device.

The bench runs torchrun (:func:`tandem.distributed.torchrun.run_captured`) with one worker per
device; each worker rebuilds the model and batch from the seed, takes its shard and races its
contestants in the same order on every rank, so collectives pair up. After the race a short
all-reduce measures the link (:func:`tandem.strategies.auto.link_rate`), and rank 0 writes the
results and that rate. This phase is not interleaved with the in-process one, so the machine may have changed
in between. Directly::

    python -m torch.distributed.run --nnodes 1 --nproc-per-node N \\
        --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:0 \\
        -m tandem_bench.distributed --config CONFIG.json --contestants ENTRIES.json \\
        --out OUT.json

where ENTRIES.json is a list of :meth:`.entry.Entry.to_json`.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import subprocess
import tempfile
from dataclasses import dataclass, field

import torch
from torch import nn

from tandem import cpu_malloc
from tandem.distributed import torchrun
from tandem.distributed.env import DistEnv, Environment, malloc_left_alone, read_env, threads_set
from tandem.distributed.process_group import destroy_process_group, init_process_group
from tandem.models import create_model
from tandem.strategies.auto import link_rate

from .baselines import torch_ddp_contestant, torch_ddp_skip_reason
from .contestants import Contestant, synthetic_batch
from .entry import Entry
from .loop_twin import build_strategy
from .options import BenchConfig
from .runner import empty_result, race
from .skips import strategy_skip_reason


@dataclass
class TorchrunPhase:
    """What the phase gives back: one result per entry, and the link's rate (bytes per second
    each process sent in an all-reduce; ``None`` where the phase did not run or failed)."""

    results: list[dict] = field(default_factory=list)
    link_bytes_per_s: float | None = None


def _shape_only(config: BenchConfig) -> nn.Module:
    """``config.arch``'s model on the meta device: its structure, for a strategy's
    ``check_model``, without its memory."""
    with torch.device("meta"):
        return create_model(config.arch, num_classes=config.num_classes)


def _skip_reason(entry: Entry, config: BenchConfig, custom_model: bool,
                 model: nn.Module | None) -> str | None:
    """Why ``entry`` cannot run in a torchrun phase here, machine limits first; ``model``
    (its structure) for the strategy's own checks (hybrid-ddp needs a head to split)."""
    devices = config.device_list
    if not torch.distributed.is_available():
        return "torch.distributed is not available in this build"
    if entry.kind == "baseline":
        reason = torch_ddp_skip_reason(devices, config.sync_bn)
        if reason is None and config.batch_size < len(devices):
            # tandem's ddp handles empty shares; torch's DDP is not asked to
            reason = f"batch {config.batch_size} is smaller than the {len(devices)} processes"
    else:
        reason = strategy_skip_reason(entry.base, model, config.arch, entry.compiled,
                                      devices[0].type)
    if reason is None and custom_model:
        reason = "a custom model cannot be rebuilt in torchrun workers"
    return reason


def distributed_phase(config: BenchConfig, entries: list[Entry], custom_model: bool = False,
                      ) -> TorchrunPhase:
    """Time ``entries`` (``ddp``, ``hybrid-ddp``, ``torch_ddp``, their twins) under torchrun;
    one result each, in their order, and the link's rate."""
    devices = config.device_list
    results, runnable, rate = {}, [], None
    model = None if custom_model else _shape_only(config)
    for entry in entries:
        reason = _skip_reason(entry, config, custom_model, model)
        if reason:
            results[entry.name] = empty_result(entry.name, entry.kind, devices, "skipped",
                                               reason)
        else:
            runnable.append(entry)
    if runnable:
        launched, rate = _launch(config, runnable)
        for result in launched:
            results[result["name"]] = result
    return TorchrunPhase([results[entry.name] for entry in entries], rate)


def _launch(config: BenchConfig, entries: list[Entry]) -> tuple[list[dict], float | None]:
    nproc = len(config.device_list)
    threads = config.threads
    if threads is None and not threads_set(Environment.read()):
        threads = max(1, torch.get_num_threads() // nproc)
    with tempfile.TemporaryDirectory(prefix="tandem-bench-") as tmp:
        cfg_path, out_path = os.path.join(tmp, "config.json"), os.path.join(tmp, "out.json")
        entries_path = os.path.join(tmp, "contestants.json")
        with open(cfg_path, "w") as f:
            json.dump(config.to_dict(), f)
        with open(entries_path, "w") as f:
            json.dump([entry.to_json() for entry in entries], f)
        spec = torchrun.LaunchSpec(
            nproc_per_node=nproc, module="tandem_bench.distributed",
            command=["--config", cfg_path, "--contestants", entries_path, "--out", out_path],
            rdzv_endpoint="127.0.0.1:0", max_restarts=0,
            extra_env={} if threads is None else {"OMP_NUM_THREADS": str(threads)})
        try:
            proc = torchrun.run_captured(spec, timeout=config.dist_timeout)
            error = None if proc.returncode == 0 else (
                f"torchrun phase exited with {proc.returncode}: {_last_error(proc.stderr)}")
        except subprocess.TimeoutExpired:
            error = f"torchrun phase timed out after {config.dist_timeout:.0f}s"
        if error is None and not os.path.exists(out_path):
            error = "torchrun phase wrote no results"
        if error is not None:
            return [empty_result(e.name, e.kind, config.device_list, "failed", error,
                                 "torchrun") for e in entries], None
        with open(out_path) as f:
            out = json.load(f)
        return out["results"], out["link_bytes_per_s"]


def _last_error(stderr: str) -> str:
    """The most telling line of a worker's stderr (the last exception line, if any)."""
    lines = [l.strip() for l in stderr.splitlines() if l.strip()]
    for line in reversed(lines):
        if "Error" in line or "Exception" in line:
            return line[:300]
    return lines[-1][:300] if lines else "(no output)"


def _read_args(argv: list[str] | None) -> tuple[BenchConfig, list[Entry], str]:
    """The worker's config, its contestants and where rank 0 writes the results."""
    parser = argparse.ArgumentParser(prog="tandem_bench.distributed")
    parser.add_argument("--config", required=True)
    parser.add_argument("--contestants", required=True, help="a JSON list of Entry.to_json")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    with open(args.config) as f:
        config = BenchConfig.from_dict(json.load(f))
    with open(args.contestants) as f:
        entries = [Entry.from_json(data) for data in json.load(f)]
    return config, entries, args.out


class _Worker:
    """One torchrun worker's contestants, built in the same order on every rank so that
    collectives pair up; it starts a process group for ``torch_ddp`` where no strategy did."""

    def __init__(self, config: BenchConfig, env: DistEnv, device: torch.device):

        self.config, self.env, self.device = config, env, device
        rank, world = env.rank, env.world_size
        torch.manual_seed(config.seed)
        self.template = create_model(config.arch, num_classes=config.num_classes)
        self.batch = synthetic_batch(config.batch_size, config.image_size,
                                     config.num_classes, config.seed)
        self.shard = tuple(t.tensor_split(world)[rank] for t in self.batch)
        self.own_group = None

    def build(self, entry: Entry) -> Contestant:
        config, device = self.config, self.device
        if entry.kind == "strategy":  # the strategy may create the process group itself
            # The strategy picks its own device: entry LOCAL_RANK of an accelerator list, or
            # the one shared "cpu" (see tandem.distributed.process_group.pick_device); each
            # rank takes its share of the global batch at every step (the split's).
            devices = [device] if device.type == "cpu" else config.device_list
            return build_strategy(entry, config, copy.deepcopy(self.template), devices,
                                  self.batch)
        if self.own_group is None:
            self.own_group = not torch.distributed.is_initialized()
            if self.own_group:
                init_process_group(self.env, device)
        contestant = torch_ddp_contestant(
            copy.deepcopy(self.template), device, self.shard,
            amp=entry.variant.precision(device, config.amp_dtype), lr=config.lr,
            channels_last=entry.variant.channels_last, sync_bn=config.sync_bn,
            compiled=entry.compiled, compile_mode=config.compile_mode)
        contestant.name = entry.name
        return contestant


def _write_results(results: list[dict], config: BenchConfig, rank: int, world: int,
                   out: str, rate: float | None) -> None:
    """Rank 0 writes ``results`` with every rank's peak memory (each knows only its own), and
    the link's ``rate``."""
    peaks = [None] * world
    torch.distributed.all_gather_object(peaks, [r["peak_memory_bytes"][0] for r in results])
    if rank == 0:
        for i, result in enumerate(results):
            result["devices"] = [str(d) for d in config.device_list]
            result["peak_memory_bytes"] = [peaks[r][i] for r in range(world)]
        with open(out, "w") as f:
            json.dump({"results": results, "link_bytes_per_s": rate}, f)


def worker_main(argv: list[str] | None = None) -> int:
    """Entry point of one torchrun worker (see the module docstring)."""
    import torch.distributed as dist


    config, entries, out = _read_args(argv)
    cpu_malloc.tune(malloc_left_alone(Environment.read()))  # as the tandem command does
    env = read_env(Environment.read(), who="tandem_bench.distributed")
    rank, world = env.rank, env.world_size
    device = config.device_list[env.local_rank]
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = config.cudnn_benchmark
    worker = _Worker(config, env, device)
    contestants = [worker.build(entry) for entry in entries]  # in this order on every rank
    threads = torch.get_num_threads()
    for contestant in contestants:
        contestant.notes.append(f"torchrun phase: {world} processes, {threads} torch threads each")
    results = race(contestants, config.steps, config.warmup, config.batch_size,
                   phase="torchrun", catch=False)
    rate = link_rate()  # on the group the contestants joined, every rank alike
    _write_results(results, config, rank, world, out, rate if math.isfinite(rate) else None)
    # Nobody tears its process group down while a peer may still be talking to it.
    dist.barrier()
    for contestant in contestants:
        contestant.close()
    if worker.own_group:  # else the ddp strategy's close() left it
        destroy_process_group()
    return 0


if __name__ == "__main__":
    # A worker that joined a process group must not finalize the interpreter while gloo's
    # threads may still free tensors (SIGABRT at exit, about 1 run in 20 under load): see
    # tandem.distributed.process_group.exit_process, the way the tandem command ends too.
    from tandem.distributed.process_group import exit_process

    exit_process(worker_main())
