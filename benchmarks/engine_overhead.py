"""Engine overhead: a CIFAR ResNet training step, bare next to DataParallel over 1 and 2 CPU replicas.

Each configuration has its own copy of the same model and an SGD optimizer. Rounds are
interleaved (every round runs one timed step of every configuration, in a rotating order), so
load from other processes hits all of them alike; the report gives median seconds per step and
the ratio to the bare step. Run::

    python benchmarks/engine_overhead.py                # defaults: batch 128, 15 rounds
    python benchmarks/engine_overhead.py --rounds 30 --json results.json

Targets: DataParallel over one device within 5% of the bare step, over two CPU replicas within
10% (on a 2-core machine the bare step uses both cores through intra-op threads, the two
replicas one core each).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
from torch import nn

from tandem.parallel import DataParallel


def _small_resnet(num_classes: int = 10) -> nn.Module:
    """Fallback: a ResNet-20-shaped CIFAR net (3 stages of 3 basic blocks, 16/32/64 channels)."""

    class Block(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.short = (nn.Sequential() if stride == 1 and cin == cout else
                          nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)))

        def forward(self, x):
            out = torch.relu(self.bn1(self.conv1(x)))
            return torch.relu(self.bn2(self.conv2(out)) + self.short(x))

    layers = [nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU()]
    cin = 16
    for cout, stride in [(16, 1), (32, 2), (64, 2)]:
        for i in range(3):
            layers.append(Block(cin, cout, stride if i == 0 else 1))
            cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes)]
    return nn.Sequential(*layers)


def make_model() -> tuple[nn.Module, str]:
    try:
        from tandem.models import create_model
        return create_model("cifar_resnet20", num_classes=10), "cifar_resnet20"
    except (ImportError, AttributeError, ValueError, KeyError):
        return _small_resnet(), "local resnet20-shaped net"


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
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    base, name = make_model()
    configs = {
        "bare": copy.deepcopy(base),
        "dp1": DataParallel(copy.deepcopy(base), ["cpu"]),
        "dp2": DataParallel(copy.deepcopy(base), ["cpu", "cpu"]),
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
        "median_s": median,
        "ratio_dp1": median["dp1"] / median["bare"],
        "ratio_dp2": median["dp2"] / median["bare"],
    }
    print(f"{name}, batch {args.batch}, {args.rounds} interleaved rounds, "
          f"{torch.get_num_threads()} intra-op threads")
    for k in steps:
        print(f"  {k:5s} median {median[k] * 1000:8.1f} ms/step  ratio {median[k] / median['bare']:.3f}")
    print(f"  overhead: 1 device {100 * (result['ratio_dp1'] - 1):+.1f}% (target <= 5%), "
          f"2 replicas {100 * (result['ratio_dp2'] - 1):+.1f}% (target <= 10%)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
