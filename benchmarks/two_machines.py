"""DDP across two machines: step time and bytes on the wire, per link speed.

Two network namespaces joined by a veth pair (tests/support/two_machines.py; needs root and
iproute2), the link unshaped or limited with ``tc ... tbf``. For each model and rate the same
two-node ``tandem launch ... -- train --strategy ddp`` runs twice, for 1 and for 1 + K optimizer
steps; the differences give one step's seconds (the epoch's train time from metrics.jsonl, without
start-up or validation) and its bytes (both veth ends' transmitted bytes). Run as root::

    python benchmarks/two_machines.py                       # resnet18 alexnet vgg11, 3 rates
    python benchmarks/two_machines.py --arch alexnet --rates none,100mbit --steps 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "support"))

from two_machines import ADDRS, TwoMachines, unavailable  # noqa: E402


def _tx(net) -> int:
    total = 0
    for ns, link in zip(net.ns, net.links):
        path = f"/sys/class/net/{link}/statistics/tx_bytes"
        total += int(subprocess.run(["ip", "netns", "exec", ns, "cat", path], check=True,
                                    capture_output=True, text=True).stdout)
    return total


def _run(net, arch: str, steps: int, args, port: int) -> tuple[float, int]:
    """(the epoch's train seconds, bytes both ends sent) of a ``steps``-step two-node run."""
    job = ["train", "--strategy", "ddp", "--arch", arch, "--data", "synthetic",
           "--num-classes", "10", "--image-size", str(args.image_size), "-b", str(args.batch),
           "--synthetic-size", str(args.batch * 64), "--max-steps", str(steps), "--epochs", "1",
           "--no-progress", "--workers", "0", "--out", f"runs/{arch}{steps}", "--overwrite"]
    env = dict(os.environ, OMP_NUM_THREADS="1", TANDEM_DIST_TIMEOUT="600")
    before = _tx(net)
    procs = [net.start(node, [sys.executable, "-m", "tandem", "launch", "--nnodes", "2",
                              "--nproc-per-node", "1", "--node-rank", str(node),
                              "--master-addr", ADDRS[0], "--master-port", str(port), "--", *job],
                       env) for node in (0, 1)]
    for proc in procs:
        out, err = proc.communicate(timeout=3600)
        if proc.returncode != 0:
            raise SystemExit(f"{arch} failed: {err[-2000:]}")
    sent = _tx(net) - before
    with open(os.path.join(net.dirs[0], f"runs/{arch}{steps}", "metrics.jsonl")) as f:
        seconds = json.loads(f.readline())["seconds"]
    return seconds, sent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="resnet18,alexnet,vgg11")
    p.add_argument("--rates", default="none,1gbit,100mbit")
    p.add_argument("--steps", type=int, default=2, help="K: the steps measured")
    p.add_argument("--batch", type=int, default=8, help="global batch (4 a node)")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    why = unavailable()
    if why:
        raise SystemExit(f"two_machines.py {why}")
    rows, port = [], 29800
    with tempfile.TemporaryDirectory() as root, TwoMachines(root) as net:
        for arch in args.arch.split(","):
            for rate in args.rates.split(","):
                net.shape(None if rate == "none" else rate)
                port += 2
                s1, b1 = _run(net, arch, 1, args, port)
                sk, bk = _run(net, arch, 1 + args.steps, args, port + 1)
                row = {"arch": arch, "rate": rate, "step_s": (sk - s1) / args.steps,
                       "mb_per_step": (bk - b1) / args.steps / 1e6}
                rows.append(row)
                print(f"{arch:9} {rate:8} {row['step_s']:8.2f} s/step "
                      f"{row['mb_per_step']:9.1f} MB/step", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
