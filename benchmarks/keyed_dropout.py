"""Keyed dropout's cost: a CPU training step with tandem's keyed masks next to torch's own draws.

Each model is trained twice from the same weights: once with its layers as torch's
(``nn.Dropout``, drawing from torch's generator), once converted by
``tandem.keyed.keyed_dropout`` and stepped inside a keyed stream, as ``tandem train`` does by
default. Rounds are interleaved (every round times one step of each, the order alternating),
so load from other processes hits both alike; the report gives each median step and the
ratio. Run::

    python benchmarks/keyed_dropout.py                       # every model, 30 rounds
    python benchmarks/keyed_dropout.py --models alexnet --rounds 30 --json keyed.json

Models: ``alexnet`` (the zoo's, dropout 0.5 before fc6 and fc7; at 64 px, batch 32, its
classifier is most of the step), ``resnet20`` (``cifar_resnet20 --drop-path 0.1``, 32 px,
batch 32: one keep per sample in 8 blocks), and ``mlp``, a worst case that is not a conv net:
two 4096-wide Linear layers each followed by dropout 0.5 (batch 64), where the masks are a
large part of the step. Target:
keyed within 3% of torch on the conv nets (benchmarks/keyed-dropout in the docs).
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
from tandem.keyed import keyed_dropout, step_stream
from tandem.models import create_model

# name: (model, image side, batch, classes)
MODELS = {
    "alexnet": (lambda: create_model("alexnet", num_classes=10), 64, 32, 10),
    "resnet20": (lambda: create_model("cifar_resnet20", drop_path=0.1), 32, 32, 10),
    "mlp": (lambda: nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 4096), nn.ReLU(),
                                  nn.Dropout(0.5), nn.Linear(4096, 4096), nn.ReLU(),
                                  nn.Dropout(0.5), nn.Linear(4096, 10)), 32, 64, 10),
}


def make_step(model: nn.Module, keyed: bool):
    criterion = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    counter = [0]

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        counter[0] += 1
        if keyed:  # the loop's stream: a new key each step, this process's rows from 0
            with step_stream(0, counter[0], 0):
                out = model(x)
        else:
            out = model(x)
        loss = criterion(out, y)
        loss.backward()
        opt.step()
        return loss

    return step


def bench(name: str, rounds: int, warmup: int) -> dict:
    build, size, batch, classes = MODELS[name]
    torch.manual_seed(0)
    base = build().train()
    steps = {"torch": make_step(copy.deepcopy(base), False),
             "keyed": make_step(keyed_dropout(copy.deepcopy(base)), True)}
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 3, size, size, generator=g)
    y = torch.randint(0, classes, (batch,), generator=g)
    for _ in range(warmup):
        for step in steps.values():
            step(x, y)
    times: dict[str, list[float]] = {k: [] for k in steps}
    order = list(steps)
    for r in range(rounds):
        for k in order if r % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            steps[k](x, y)
            times[k].append(time.perf_counter() - start)
    median = {k: statistics.median(v) for k, v in times.items()}
    return {"model": name, "image_size": size, "batch": batch, "rounds": rounds,
            "median_s": median, "ratio": median["keyed"] / median["torch"]}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    tuned = cpu_malloc.tune()  # as the tandem command does
    print(f"{args.rounds} interleaved rounds, {torch.get_num_threads()} intra-op threads, "
          f"torch {torch.__version__}, malloc {'tuned' if tuned else 'default'}")
    results = []
    for name in args.models.split(","):
        result = bench(name, args.rounds, args.warmup)
        results.append(result)
        m = result["median_s"]
        print(f"  {name:9s} {result['image_size']:3d} px, batch {result['batch']:3d}: "
              f"torch {m['torch'] * 1000:8.1f} ms  keyed {m['keyed'] * 1000:8.1f} ms  "
              f"ratio {result['ratio']:.3f} ({100 * (result['ratio'] - 1):+.1f}%)", flush=True)
    if args.json:
        write_json({"torch": torch.__version__, "intra_op_threads": torch.get_num_threads(),
                    "results": results}, args.json)
    return results


if __name__ == "__main__":
    main()
