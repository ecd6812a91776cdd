"""Where a CPU training step spends its time, eager against ``torch.compile`` (torch.profiler).

Builds two copies of the same model (one compiled as ``tandem train --compile`` does), runs
``--warmup`` untimed steps each (the compiled copy compiles there), then profiles ``--steps``
steps of each and prints the operators with the most self CPU time. It answers "what would a
compiler remove?" before anyone optimises::

    python benchmarks/profile_compile.py --batch-size 128 --threads 1 --steps 3

It is not a timing benchmark (the profiler adds overhead); ``tandem bench --compile`` is.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from tandem.models import create_model
from tandem.strategies.compile import compiled


def _step(model: nn.Module, opt, images, targets) -> None:
    opt.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(images), targets).backward()
    opt.step()


def profile_model(model: nn.Module, images, targets, warmup: int, steps: int, rows: int) -> str:
    """Warm up, then profile ``steps`` steps; the top ``rows`` operators by self CPU time."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    start = time.perf_counter()
    for _ in range(warmup):
        _step(model, opt, images, targets)
    first = time.perf_counter() - start
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            _step(model, opt, images, targets)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
    return f"warm-up {warmup} steps: {first:.1f}s\n{table}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="cifar_resnet20")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rows", type=int, default=15)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = create_model(args.arch, num_classes=10)
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    targets = torch.randint(0, 10, (args.batch_size,))
    for name, m in (("eager", copy.deepcopy(model)), ("compiled", compiled(model))):
        print(f"== {name}: {args.arch}, batch {args.batch_size}, {torch.get_num_threads()} "
              f"threads, {args.steps} profiled steps")
        print(profile_model(m, images, targets, args.warmup, args.steps, args.rows), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
