"""Engine overhead: a CIFAR ResNet training step, bare next to DataParallel over 1 and 2 CPU replicas.

Each configuration has its own copy of the same model and an SGD optimizer. Rounds are
interleaved (every round runs one timed step of every configuration, in a rotating order), so
load from other processes hits all of them alike; the report gives median seconds per step and
the ratio to the bare step. Run::

    python benchmarks/engine_overhead.py                # defaults: batch 128, 30 rounds
    python benchmarks/engine_overhead.py --rounds 60 --json results.json

Targets: DataParallel over one device within 5% of the bare step, over two CPU replicas within
10% (on a 2-core machine the bare step uses both cores through intra-op threads, the two
replicas one core each). ``dp2_thr`` is two replicas with ``backward_threads=True``: each
replica's backward in its own thread, one intra-op thread each, where ``dp2`` runs both in
autograd's one thread with 2 intra-op threads.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn

from tandem import cpu_malloc
from tandem_bench import write_json
from tandem.models import create_model
from tandem.parallel import DataParallel

MODEL = "cifar_resnet20"


def make_step(model: nn.Module):
    criterion = nn.CrossEntropyLoss()
    params = model.module.parameters() if isinstance(model, DataParallel) else model.parameters()
    opt = torch.optim.SGD(params, lr=0.01, momentum=0.9)

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = criterion(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return step


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    tuned = cpu_malloc.tune()  # as the tandem command does; TANDEM_MALLOC=default for glibc's

    torch.manual_seed(0)
    base, name = create_model(MODEL), MODEL  # 10 classes by default
    configs = {
        "bare": copy.deepcopy(base),
        "dp1": DataParallel(copy.deepcopy(base), ["cpu"]),
        "dp2": DataParallel(copy.deepcopy(base), ["cpu", "cpu"]),
        # the same, each replica's backward forced into its own thread (the default keeps
        # autograd's one thread here: with 2 intra-op threads the replica threads add no core)
        "dp2_thr": DataParallel(copy.deepcopy(base), ["cpu", "cpu"], backward_threads=True),
    }
    steps = {k: make_step(m) for k, m in configs.items()}
    x = torch.randn(args.batch, 3, 32, 32)
    y = torch.randint(0, 10, (args.batch,))
    for _ in range(args.warmup):
        for step in steps.values():
            step(x, y)
    times: dict[str, list[float]] = {k: [] for k in steps}
    order = list(steps)
    for r in range(args.rounds):
        for k in order[r % len(order):] + order[: r % len(order)]:  # rotate who goes first
            start = time.perf_counter()
            steps[k](x, y)
            times[k].append(time.perf_counter() - start)

    median = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "model": name, "batch": args.batch, "rounds": args.rounds,
        "intra_op_threads": torch.get_num_threads(), "torch": torch.__version__,
        "malloc_tuned": tuned,
        "median_s": median,
        "ratio_dp1": median["dp1"] / median["bare"],
        "ratio_dp2": median["dp2"] / median["bare"],
        "ratio_dp2_thr": median["dp2_thr"] / median["bare"],
    }
    print(f"{name}, batch {args.batch}, {args.rounds} interleaved rounds, "
          f"{torch.get_num_threads()} intra-op threads, malloc {'tuned' if tuned else 'default'}")
    for k in steps:
        print(f"  {k:7s} median {median[k] * 1000:8.1f} ms/step  ratio {median[k] / median['bare']:.3f}")
    print(f"  overhead: 1 device {100 * (result['ratio_dp1'] - 1):+.1f}% (target <= 5%), "
          f"2 replicas {100 * (result['ratio_dp2'] - 1):+.1f}% (target <= 10%)")
    if args.json:
        write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
