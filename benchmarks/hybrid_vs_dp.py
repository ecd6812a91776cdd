"""Hybrid ("one weird trick") versus pure data parallel: step time and bytes moved per step.

Both contestants start from the same weights and train on the same synthetic batches: a full
step is forward, cross-entropy, backward and an SGD (momentum) step. After a warm-up they are
timed interleaved, round by round (``dp, hybrid, dp, hybrid, ...``), so that a machine whose
load drifts slows both alike; medians and the hybrid/dp ratio are reported.

Bytes are what :class:`tandem.parallel.traffic.TrafficMeter` records during one step: the
engine's ``scatter``/``broadcast``/``reduce``/``gather`` and hybrid's ``activations`` /
``activation_grads``. Counts are logical: on ``cpu:2`` the two replicas share the machine's
memory, so nothing is copied and the time does not include any transfer, yet the bytes are
those the same layout moves between two real devices. ``tandem.hybrid.plan``'s prediction is
printed next to the measurement (the engine records its scatter and gather forward only; the
plan counts both directions, see its docstring).

    python benchmarks/hybrid_vs_dp.py                       # alexnet, cpu:2, batch 16 at 64x64
    python benchmarks/hybrid_vs_dp.py --devices cuda:0,1 --batch 128 --size 224 --json out.json
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch
from torch import nn

from tandem.hybrid import HybridParallel, plan
from tandem.models import create_model
from tandem.parallel import DataParallel
from tandem.parallel.devices import parse_device_spec
from tandem_bench import write_json
from tandem.parallel.traffic import TrafficMeter

__all__ = ["main", "run"]


def _sync(devices) -> None:
    for d in {d for d in devices if d.type == "cuda"}:
        torch.cuda.synchronize(d)


def _step(wrapped: nn.Module, opt, x, y) -> float:
    opt.zero_grad(set_to_none=True)
    out = wrapped(x)
    loss = nn.functional.cross_entropy(out, y.to(out.device))
    loss.backward()
    opt.step()
    return loss.item()


def run(arch="alexnet", devices="cpu:2", batch=16, size=64, classes=1000, rounds=10, warmup=2,
        seed=0) -> dict:
    devs = parse_device_spec(devices)
    torch.manual_seed(seed)
    base = create_model(arch, num_classes=classes, dropout=0.0)
    contestants = {
        "dp": DataParallel(copy.deepcopy(base).to(devs[0]), device_ids=devs),
        "hybrid": HybridParallel(copy.deepcopy(base), device_ids=devs),
    }
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
            for k, m in contestants.items()}
    gen = torch.Generator().manual_seed(seed)
    batches = [(torch.randn(batch, 3, size, size, generator=gen),
                torch.randint(0, classes, (batch,), generator=gen)) for _ in range(4)]

    # One metered step each, from identical weights: equal losses show both are the same step.
    traffic, losses = {}, {}
    for name, m in contestants.items():
        x, y = batches[0]
        with TrafficMeter() as meter:
            losses[name] = _step(m, opts[name], x.to(devs[0]), y)
        traffic[name] = {"total": meter.total, "by_kind": dict(sorted(meter.by_kind.items()))}
    if abs(losses["dp"] - losses["hybrid"]) > 1e-4 * max(1.0, abs(losses["dp"])):
        raise AssertionError(f"first-step losses differ: dp {losses['dp']}, hybrid "
                             f"{losses['hybrid']}")

    times: dict[str, list[float]] = {k: [] for k in contestants}
    for r in range(warmup + rounds):
        for name, m in contestants.items():
            x, y = batches[r % len(batches)]
            x = x.to(devs[0])
            _sync(devs)
            t0 = time.perf_counter()
            _step(m, opts[name], x, y)
            _sync(devs)
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)

    med = {k: statistics.median(v) for k, v in times.items()}
    predicted = plan(base, len(devs), batch_size=batch, input_size=(3, size, size))
    return {
        "arch": arch, "devices": [str(d) for d in devs], "batch": batch, "size": size,
        "classes": classes, "rounds": rounds, "warmup": warmup, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "first_step_loss": losses,
        "step_seconds": times, "median_seconds": med,
        "hybrid_over_dp_time": med["hybrid"] / med["dp"],
        "bytes_measured": traffic,
        "dp_over_hybrid_bytes": traffic["dp"]["total"] / max(1, traffic["hybrid"]["total"]),
        "bytes_planned": {"dp": predicted.dp_bytes, "hybrid": predicted.hybrid_bytes},
        "plan_verdict": predicted.verdict,
        "plan_report": predicted.report(),
    }


def format_result(res: dict) -> str:
    mb = 1e6
    lines = [f"{res['arch']} on {','.join(res['devices'])}, batch {res['batch']} at "
             f"{res['size']}x{res['size']}, {res['classes']} classes, {res['rounds']} "
             f"interleaved rounds (median), torch {res['torch']}, {res['threads']} threads",
             f"{'':<8}{'step ms':>10}{'MB/step measured':>18}{'MB/step planned':>17}"]
    for name in ("dp", "hybrid"):
        planned = sum(res["bytes_planned"][name].values())
        lines.append(f"{name:<8}{res['median_seconds'][name] * 1e3:>10.1f}"
                     f"{res['bytes_measured'][name]['total'] / mb:>18.2f}{planned / mb:>17.2f}")
    lines.append(f"hybrid/dp step time {res['hybrid_over_dp_time']:.2f}x; dp moves "
                 f"{res['dp_over_hybrid_bytes']:.1f}x the bytes of hybrid (measured)")
    for name in ("dp", "hybrid"):
        kinds = ", ".join(f"{k} {v / mb:.2f}" for k, v in res["bytes_measured"][name]["by_kind"].items())
        lines.append(f"  {name} measured MB by kind: {kinds}")
    lines.append(f"plan: {res['plan_verdict']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-a", "--arch", default="alexnet")
    p.add_argument("--devices", default="cpu:2", help="cpu:N, cuda:0,1, ... (default %(default)s)")
    p.add_argument("-b", "--batch", type=int, default=16)
    p.add_argument("--size", type=int, default=64, help="square image side")
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plan", action="store_true", help="also print the plan's full report")
    p.add_argument("--json", metavar="PATH", help="write every field as JSON ('-' for stdout)")
    args = p.parse_args(argv)
    if min(args.batch, args.size, args.classes, args.rounds) < 1 or args.warmup < 0:
        p.error("--batch, --size, --classes, --rounds must be >= 1 and --warmup >= 0")
    res = run(args.arch, args.devices, args.batch, args.size, args.classes, args.rounds,
              args.warmup, args.seed)
    out = sys.stderr if args.json == "-" else sys.stdout
    print(format_result(res), file=out)
    if args.plan:
        print(res["plan_report"], file=out)
    if args.json:
        write_json(res, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
