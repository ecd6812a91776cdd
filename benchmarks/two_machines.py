"""DDP and the hybrid across two machines: step time and bytes on the wire, per link speed.

Two network namespaces joined by a veth pair (tests/support/two_machines.py; needs root and
iproute2), the link unshaped or limited with ``tc ... tbf``. For each model and rate, each strategy's
two-node ``tandem launch ... -- train --strategy S`` runs twice, for B and for B + K optimizer
steps (``--base B``, 1 unless given), the strategies interleaved (ddp 1, hybrid-ddp 1, ddp 1+K, hybrid-ddp 1+K) so that both
see the same machine; the differences give one step's seconds (the epoch's train time from
metrics.jsonl, without start-up or validation) and its bytes (both veth ends' transmitted
bytes). Beside them: the bytes :func:`tandem.hybrid.cost.step_bytes` predicts (both
ranks' sum, what both ends send) and the busiest rank's bytes over the rate (the predicted
communication seconds; each direction of the link carries one rank's). A contestant
``ddp+MODE`` is ddp with ``--grad-compression MODE`` (PowerSGD's first 2 steps are exact and
its third all-reduces exactly once more, the epoch's measured error: ``--base 4`` measures
steps after those). Run as root::

    python benchmarks/two_machines.py                       # resnet18 alexnet vgg11, 3 rates
    python benchmarks/two_machines.py --arch alexnet --rates none,100mbit --steps 2
    python benchmarks/two_machines.py --strategies ddp --rates 100mbit
    python benchmarks/two_machines.py --arch resnet18 --rates 100mbit --base 4 \
        --strategies ddp,ddp+bf16,ddp+powersgd:2,ddp+powersgd:4
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "support"))

from two_machines import ADDRS, TwoMachines, unavailable  # noqa: E402

from tandem.distributed.compression import Compression  # noqa: E402
from tandem.errors import UsageError  # noqa: E402
from tandem.hybrid.cost import ProcessBytes, step_bytes  # noqa: E402
from tandem.models import create_model  # noqa: E402

#: tc's rate units, in bits per second
_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def _bytes_per_s(rate: str) -> float | None:
    """``"100mbit"`` as bytes per second; None unshaped (``"none"``)."""
    if rate == "none":
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([a-z]+)", rate)
    if not match or match.group(2) not in _UNITS:
        raise SystemExit(f"two_machines.py: rate {rate!r}: expected none or a number with "
                         f"one of {', '.join(_UNITS)} (tc's units)")
    return float(match.group(1)) * _UNITS[match.group(2)] / 8


def _tx(net) -> int:
    total = 0
    for ns, link in zip(net.ns, net.links):
        path = f"/sys/class/net/{link}/statistics/tx_bytes"
        total += int(subprocess.run(["ip", "netns", "exec", ns, "cat", path], check=True,
                                    capture_output=True, text=True).stdout)
    return total


def _run(net, arch: str, strategy: str, steps: int, args, port: int) -> tuple[float, int]:
    """(the epoch's train seconds, bytes both ends sent) of a ``steps``-step two-node run."""
    name, _, mode = strategy.partition("+")
    out = f"runs/{strategy.replace(':', '-').replace('+', '-')}-{arch}{steps}"
    job = ["train", "--strategy", name, *(["--grad-compression", mode] if mode else []),
           "--arch", arch, "--data", "synthetic",
           "--num-classes", "10", "--image-size", str(args.image_size), "-b", str(args.batch),
           "--synthetic-size", str(args.batch * 64), "--max-steps", str(steps), "--epochs", "1",
           "--no-progress", "--workers", "0", "--out", out, "--overwrite"]
    env = dict(os.environ, OMP_NUM_THREADS="1", TANDEM_DIST_TIMEOUT="600")
    before = _tx(net)
    procs = [net.start(node, [sys.executable, "-m", "tandem", "launch", "--nnodes", "2",
                              "--nproc-per-node", "1", "--node-rank", str(node),
                              "--master-addr", ADDRS[0], "--master-port", str(port), "--", *job],
                       env) for node in (0, 1)]
    for proc in procs:
        _, err = proc.communicate(timeout=3600)
        if proc.returncode != 0:
            raise SystemExit(f"{strategy} {arch} failed: {err[-2000:]}")
    sent = _tx(net) - before
    with open(os.path.join(net.dirs[0], out, "metrics.jsonl")) as f:
        seconds = json.loads(f.readline())["seconds"]
    return seconds, sent


def _predicted(arch: str, batch: int, strategy: str) -> list[dict]:
    """step_bytes of ``arch`` (10 classes) over 2 processes: ``strategy``'s ranks."""
    name, _, mode = strategy.partition("+")
    cost = step_bytes(create_model(arch, num_classes=10), batch, 2, backend="gloo",
                      compression=Compression.parse(mode or "none"))
    return cost.ddp if name == "ddp" else cost.hybrid


def _measure(net, arch: str, rate: str, strategies: list[str], args, port: int) -> list[dict]:
    """One row per strategy at this model and rate, the strategies' runs interleaved."""
    net.shape(None if rate == "none" else rate)
    runs = {}
    for steps in (args.base, args.base + args.steps):
        for strategy in strategies:
            port += 1
            runs[strategy, steps] = _run(net, arch, strategy, steps, args, port)
    speed = _bytes_per_s(rate)
    rows = []
    for strategy in strategies:
        (s1, b1), (sk, bk) = runs[strategy, args.base], runs[strategy, args.base + args.steps]
        ranks = _predicted(arch, args.batch, strategy)
        busiest = ProcessBytes.most(ranks)
        rows.append({"arch": arch, "rate": rate, "strategy": strategy,
                     "step_s": (sk - s1) / args.steps,
                     "mb_per_step": (bk - b1) / args.steps / 1e6,
                     "predicted_mb": sum(sum(r.values()) for r in ranks) / 1e6,
                     "predicted_wire_s": None if speed is None else busiest / speed})
    if "ddp" in strategies:
        ddp = next(r for r in rows if r["strategy"] == "ddp")["step_s"]
        for row in rows:
            row["vs_ddp"] = row["step_s"] / ddp
    return rows


def _line(row: dict) -> str:
    wire = "" if row["predicted_wire_s"] is None else f"{row['predicted_wire_s']:.2f}"
    ratio = f"{row['vs_ddp']:.2f}x" if "vs_ddp" in row else ""
    return (f"| {row['arch']} | {row['rate']} | {row['strategy']} | {row['step_s']:.2f} | "
            f"{row['mb_per_step']:.1f} | {row['predicted_mb']:.1f} | {wire} | {ratio} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="resnet18,alexnet,vgg11")
    p.add_argument("--rates", default="none,1gbit,100mbit")
    p.add_argument("--strategies", default="ddp,hybrid-ddp",
                   help="measured side by side, interleaved (ddp first: the ratio's base)")
    p.add_argument("--steps", type=int, default=2, help="K: the steps measured")
    p.add_argument("--base", type=int, default=1, help="B: the steps before them")
    p.add_argument("--batch", type=int, default=8, help="global batch (4 a node)")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    strategies = args.strategies.split(",")
    unknown = sorted(s for s in strategies if s.partition("+")[0] not in ("ddp", "hybrid-ddp"))
    if unknown:
        raise SystemExit(f"two_machines.py: --strategies: {', '.join(unknown)}: expected ddp, "
                         f"hybrid-ddp or ddp+MODE (a --grad-compression)")
    for s in strategies:  # a bad mode is told before anything starts
        try:
            Compression.parse(s.partition("+")[2] or "none")
        except UsageError as exc:
            raise SystemExit(f"two_machines.py: --strategies {s}: {exc}") from None
    for rate in args.rates.split(","):
        _bytes_per_s(rate)  # a wrong unit is told before anything starts
    why = unavailable()
    if why:
        raise SystemExit(f"two_machines.py {why}")
    print("| model | link | strategy | s / step | MB / step (both directions) | "
          "MB predicted (step_bytes) | predicted wire s | vs ddp |\n"
          "|---|---|---|---|---|---|---|---|", flush=True)
    rows, port = [], 29800
    with tempfile.TemporaryDirectory() as root, TwoMachines(root) as net:
        for arch in args.arch.split(","):
            for rate in args.rates.split(","):
                measured = _measure(net, arch, rate, strategies, args, port)
                port += 2 * len(strategies)
                rows += measured
                for row in measured:
                    print(_line(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
