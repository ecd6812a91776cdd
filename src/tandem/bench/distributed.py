"""The torchrun phase: ``ddp`` and ``torch_ddp`` (and twins, ``ddp/loop`` too), one process
per device.

The bench runs torchrun (:func:`tandem.distributed.launch.run_captured`) with one worker per
device; each worker rebuilds the model and batch from the seed, takes its shard and races its
contestants in the same order on every rank, so collectives pair up. Rank 0 writes the
results. This phase is not interleaved with the in-process one, so the machine may have changed
in between. Directly::

    python -m torch.distributed.run --nnodes 1 --nproc-per-node N \\
        --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:0 \\
        -m tandem.bench.distributed --config CONFIG.json --names ddp,torch_ddp --out OUT.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import tempfile

import torch

from tandem.distributed import launch
from tandem.distributed.env import read_env
from tandem.distributed.process_group import backend_for

from .baselines import torch_ddp_contestant, torch_ddp_skip_reason
from .config import BenchConfig
from .contestants import Contestant, split_of, synthetic_batch
from .loop import builder, loop_base
from .runner import empty_result, race
from .variants import split_name

__all__ = ["distributed_phase", "worker_main"]


def _kind(name: str) -> str:  # a loop twin is a strategy's
    return "baseline" if name.startswith("torch_ddp") else "strategy"


def _skip_reason(name: str, config: BenchConfig, custom_model: bool) -> str | None:
    """Why ``name`` cannot run in a torchrun phase here, machine limits first."""
    devices = config.device_list
    if not torch.distributed.is_available():
        return "torch.distributed is not available in this build"
    if _kind(name) == "baseline":
        reason = torch_ddp_skip_reason(devices, config.sync_bn)
        if reason is None and config.batch_size < len(devices):
            # tandem's ddp handles empty shares; torch's DDP is not asked to
            reason = f"batch {config.batch_size} is smaller than the {len(devices)} processes"
    else:
        from .suite import strategy_skip_reason

        label, _, compiled = split_name(loop_base(name)[0], config)
        reason = strategy_skip_reason(split_of(label, None)[0], None, config.arch, compiled,
                                      devices[0].type)
    if reason is None and custom_model:
        reason = "a custom model cannot be rebuilt in torchrun workers"
    return reason


def distributed_phase(config: BenchConfig, names: list[str], custom_model: bool = False,
                      ) -> list[dict]:
    """Time ``names`` (``ddp``, ``torch_ddp``, their twins) under torchrun; one result each."""
    devices = config.device_list
    results, runnable = {}, []
    for name in names:
        kind = _kind(name)
        reason = _skip_reason(name, config, custom_model)
        if reason:
            results[name] = empty_result(name, kind, devices, "skipped", reason)
        else:
            runnable.append(name)
    if runnable:
        for result in _launch(config, runnable):
            results[result["name"]] = result
    return [results[name] for name in names]


def _launch(config: BenchConfig, names: list[str]) -> list[dict]:
    nproc = len(config.device_list)
    threads = config.threads
    if threads is None and "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, torch.get_num_threads() // nproc)
    with tempfile.TemporaryDirectory(prefix="tandem-bench-") as tmp:
        cfg_path, out_path = os.path.join(tmp, "config.json"), os.path.join(tmp, "out.json")
        with open(cfg_path, "w") as f:
            json.dump(config.to_dict(), f)
        spec = launch.LaunchSpec(
            nproc_per_node=nproc, module="tandem.bench.distributed",
            command=["--config", cfg_path, "--names", ",".join(names), "--out", out_path],
            rdzv_endpoint="127.0.0.1:0", max_restarts=0,
            extra_env={} if threads is None else {"OMP_NUM_THREADS": str(threads)})
        try:
            proc = launch.run_captured(spec, timeout=config.dist_timeout)
            error = None if proc.returncode == 0 else (
                f"torchrun phase exited with {proc.returncode}: {_last_error(proc.stderr)}")
        except subprocess.TimeoutExpired:
            error = f"torchrun phase timed out after {config.dist_timeout:.0f}s"
        if error is None and not os.path.exists(out_path):
            error = "torchrun phase wrote no results"
        if error is not None:
            return [empty_result(n, _kind(n), config.device_list, "failed", error, "torchrun")
                    for n in names]
        with open(out_path) as f:
            return json.load(f)


def _last_error(stderr: str) -> str:
    """The most telling line of a worker's stderr (the last exception line, if any)."""
    lines = [l.strip() for l in stderr.splitlines() if l.strip()]
    for line in reversed(lines):
        if "Error" in line or "Exception" in line:
            return line[:300]
    return lines[-1][:300] if lines else "(no output)"


def worker_main(argv: list[str] | None = None) -> int:
    """Entry point of one torchrun worker (see the module docstring)."""
    import torch.distributed as dist
    from tandem.models import create_model

    parser = argparse.ArgumentParser(prog="tandem.bench.distributed")
    parser.add_argument("--config", required=True)
    parser.add_argument("--names", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    from tandem import cpu_malloc

    cpu_malloc.tune()  # as the tandem command does, so both phases time the same allocator
    with open(args.config) as f:
        config = BenchConfig.from_dict(json.load(f))
    env = read_env(who="tandem.bench.distributed")
    rank, world = env.rank, env.world_size
    device = config.device_list[env.local_rank]
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = config.cudnn_benchmark

    torch.manual_seed(config.seed)
    template = create_model(config.arch, num_classes=config.num_classes)
    images, targets = synthetic_batch(config.batch_size, config.image_size, config.num_classes,
                                      config.seed)
    shard = (images.tensor_split(world)[rank], targets.tensor_split(world)[rank])
    handicap = config.handicap_spec()
    names = args.names.split(",")
    contestants: list[Contestant] = []
    # The strategy picks its own device: entry LOCAL_RANK of an accelerator list, or the one
    # shared "cpu" (see tandem.distributed.process_group.pick_device).
    ddp_devices = [device] if device.type == "cpu" else config.device_list
    own_group = None
    for name in names:  # in this order on every rank, so that collectives pair up
        plain, loop = loop_base(name)  # "dp/auto+amp/loop": the loop twin of "dp/auto+amp"
        label, variant, compiled = split_name(plain, config)  # "dp/auto", "+amp", compiled
        amp = variant.precision(device, config.amp_dtype)
        if _kind(name) == "strategy":  # the strategy may create the process group itself
            # each rank takes its share of the global batch at every step (the split's)
            base, split = split_of(label, config.ideal_split())
            contestant = builder(loop, config)(
                base, copy.deepcopy(template), ddp_devices, (images, targets), amp=amp,
                lr=config.lr, channels_last=variant.channels_last, sync_bn=config.sync_bn,
                buffers=config.buffers, compiled=compiled, compile_mode=config.compile_mode,
                split=split, handicap=handicap)
            contestant.name = name
            contestants.append(contestant)
            continue
        if own_group is None:
            own_group = not dist.is_initialized()
            if own_group:
                dist.init_process_group(backend_for(device))
        contestants.append(torch_ddp_contestant(
            copy.deepcopy(template), device, shard, amp=amp, lr=config.lr,
            channels_last=variant.channels_last, sync_bn=config.sync_bn, compiled=compiled,
            compile_mode=config.compile_mode))
        contestants[-1].name = name
    threads = torch.get_num_threads()
    for contestant in contestants:
        contestant.notes.append(f"torchrun phase: {world} processes, {threads} torch threads each")
    results = race(contestants, config.steps, config.warmup, config.batch_size,
                   phase="torchrun", catch=False)
    # Each rank knows only its own device's peak; rank 0 reports them all.
    peaks = [None] * world
    dist.all_gather_object(peaks, [r["peak_memory_bytes"][0] for r in results])
    if rank == 0:
        for i, result in enumerate(results):
            result["devices"] = [str(d) for d in config.device_list]
            result["peak_memory_bytes"] = [peaks[r][i] for r in range(world)]
        with open(args.out, "w") as f:
            json.dump(results, f)
    # Nobody tears its process group down while a peer may still be talking to it.
    dist.barrier()
    for contestant in contestants:
        contestant.close()
    if own_group and dist.is_initialized():  # else the ddp strategy's close() left it
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    # A worker that joined a process group must not finalize the interpreter while gloo's
    # threads may still free tensors (SIGABRT at exit, about 1 run in 20 under load): see
    # tandem.distributed.process_group.exit_process, the way the tandem command ends too.
    from tandem.distributed.process_group import exit_process

    exit_process(worker_main())
