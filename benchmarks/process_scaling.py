"""Process scaling on the CPU: cifar_resnet20 images/s, 1 process next to 2 ddp processes.

Three configurations train the same model (``tandem.models.create_model("cifar_resnet20")``)
on the same fixed synthetic global batch with SGD:

- ``1 proc x 2 threads``: ``--strategy single``, ``torch.set_num_threads(2)``;
- ``1 proc x 1 thread``:  ``--strategy single``, one intra-op thread;
- ``2 procs x 1 thread``: ``--strategy ddp`` over gloo under ``torch.distributed.run``
  (torchrun, 127.0.0.1), one thread each, each process holding its half of the global batch.

Every measurement is a fresh process (or torchrun job) that builds the model, runs
``--warmup`` steps, then times ``--steps`` steps (ddp: between barriers, on rank 0).
Measurements are interleaved: each round runs every configuration once, in an order that
rotates from round to round, so load from other processes hits them alike. The report gives
the median images/s over rounds (global batch x steps / seconds) and the scaling ratios.
Process start-up is not timed. Run::

    python benchmarks/process_scaling.py                    # batch 128, 3 rounds of 10 steps
    python benchmarks/process_scaling.py --rounds 5 --json scaling.json

Target: 2 processes >= 1.6x the images/s of 1 process with 1 thread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CONFIGS = {  # name: (processes, threads per process)
    "1 proc x 2 threads": (1, 2),
    "1 proc x 1 thread": (1, 1),
    "2 procs x 1 thread": (2, 1),
}


# -- one measurement (runs inside the measured process) ----------------------------------------
def measure(args) -> None:
    import torch
    from torch import nn

    torch.set_num_threads(args.threads)
    from tandem.data.loader import shard_sizes
    from tandem.models import create_model
    from tandem.strategies import create_strategy

    distributed = "WORLD_SIZE" in os.environ
    strategy = create_strategy("ddp" if distributed else "single", [torch.device("cpu")]).launch()
    try:
        g = torch.Generator().manual_seed(0)
        images = torch.randn(args.batch_size, 3, 32, 32, generator=g)
        targets = torch.randint(0, 10, (args.batch_size,), generator=g)
        shares = shard_sizes(args.batch_size, strategy.world_size)
        images = images.split(shares)[strategy.rank]
        targets = targets.split(shares)[strategy.rank]
        torch.manual_seed(0)
        wrapped = strategy.setup(create_model("cifar_resnet20", num_classes=10))
        optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.05, momentum=0.9)
        criterion = nn.CrossEntropyLoss()
        wrapped.train()

        def step():
            out = strategy.forward_loss(wrapped, criterion, images, targets)
            optimizer.zero_grad(set_to_none=True)
            out.loss.backward()
            optimizer.step()
            return out.loss

        for _ in range(args.warmup):
            step()
        strategy.barrier()
        start = time.perf_counter()
        for _ in range(args.steps):
            loss = step()
        strategy.barrier()
        seconds = time.perf_counter() - start
        if strategy.is_main:
            with open(args.result, "w") as f:
                json.dump({"seconds": seconds, "images": args.batch_size * args.steps,
                           "loss": float(loss), "threads": torch.get_num_threads(),
                           "world_size": strategy.world_size}, f)
    finally:
        strategy.close()


# -- the driver ---------------------------------------------------------------------------------
def _run_one(name: str, args, tmp: str) -> float:
    procs, threads = CONFIGS[name]
    result = os.path.join(tmp, "result.json")
    if os.path.exists(result):
        os.remove(result)
    inner = [os.path.abspath(__file__), "--measure", "--threads", str(threads),
             "--batch-size", str(args.batch_size), "--steps", str(args.steps),
             "--warmup", str(args.warmup), "--result", result]
    if procs == 1:
        cmd = [sys.executable, *inner]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(procs),
               *inner]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TANDEM_DIST_TIMEOUT="300")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0 or not os.path.exists(result):
        raise SystemExit(f"{name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    with open(result) as f:
        r = json.load(f)
    return r["images"] / r["seconds"]


def drive(args) -> dict:
    names = list(CONFIGS)
    samples: dict[str, list[float]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="tandem-scaling-") as tmp:
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                samples[name].append(_run_one(name, args, tmp))
                print(f"round {r + 1}/{args.rounds}  {name:<20} {samples[name][-1]:8.1f} img/s",
                      flush=True)
    median = {n: statistics.median(v) for n, v in samples.items()}
    two_procs, one_thread, two_threads = (median[n] for n in
                                          ("2 procs x 1 thread", "1 proc x 1 thread",
                                           "1 proc x 2 threads"))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "arch": "cifar_resnet20", "batch_size": args.batch_size, "steps": args.steps,
        "warmup": args.warmup, "rounds": args.rounds,
        "cpus": cpus,
        "images_per_sec": samples, "median_images_per_sec": median,
        "scaling_2procs_vs_1proc_1thread": two_procs / one_thread,
        "scaling_2procs_vs_1proc_2threads": two_procs / two_threads,
        "scaling_2threads_vs_1thread": two_threads / one_thread,
    }


def report(res: dict) -> str:
    lines = [f"cifar_resnet20, synthetic 32x32, global batch {res['batch_size']}, "
             f"{res['steps']} timed steps x {res['rounds']} interleaved rounds, "
             f"{res['cpus']} CPUs", "",
             f"{'configuration':<22}{'median img/s':>14}  samples"]
    for name, value in res["median_images_per_sec"].items():
        samples = ", ".join(f"{v:.1f}" for v in res["images_per_sec"][name])
        lines.append(f"{name:<22}{value:>14.1f}  [{samples}]")
    lines += ["",
              f"2 procs / 1 proc x 1 thread : {res['scaling_2procs_vs_1proc_1thread']:.2f}x "
              "(target >= 1.6x)",
              f"2 procs / 1 proc x 2 threads: {res['scaling_2procs_vs_1proc_2threads']:.2f}x",
              f"2 threads / 1 thread        : {res['scaling_2threads_vs_1thread']:.2f}x"]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-size", type=int, default=128, help="global batch (default 128)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per measurement")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per measurement")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    p.add_argument("--timeout", type=float, default=600, help="seconds per measurement")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.measure:
        measure(args)
        return 0
    res = drive(args)
    print()
    print(report(res))
    if args.json:
        from tandem_bench import write_json

        write_json(res, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
