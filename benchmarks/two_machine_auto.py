"""What ``--strategy auto`` picks across two machines, and that a resume keeps it.

Two network namespaces joined by a veth pair (tests/support/two_machines.py; needs root and
iproute2), the link shaped with ``tc ... tbf``. For each model, one two-node ``tandem launch
... -- train --strategy auto`` races ddp and hybrid-ddp on the two processes and the link,
trains one step and records the race in node 0's ``config.json``; then the same command with ``--resume``
goes on with the choice, and node 0's output must say so without a race block. Run as root::

    python benchmarks/two_machine_auto.py                    # alexnet and resnet18, 100mbit
    python benchmarks/two_machine_auto.py --arch alexnet --rate 1gbit
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "support"))

from two_machines import ADDRS, TwoMachines, unavailable  # noqa: E402

RACE_BLOCK = "strategy auto: ddp, hybrid-ddp on 2 processes"


def _launch(net, job: list[str], port: int) -> str:
    """Node 0's stdout of a two-node ``tandem launch -- JOB`` (both nodes must succeed)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TANDEM_DIST_TIMEOUT="600")
    procs = [net.start(node, [sys.executable, "-m", "tandem", "launch", "--nnodes", "2",
                              "--nproc-per-node", "1", "--node-rank", str(node),
                              "--master-addr", ADDRS[0], "--master-port", str(port), "--", *job],
                       env) for node in (0, 1)]
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=3600)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(job[:4])} failed: {err[-2000:]}")
        outs.append(out)
    return outs[0]


def _pick(net, arch: str, args, port: int) -> dict:
    out = f"runs/auto-{arch}"
    job = ["train", "--strategy", "auto", "--arch", arch, "--data", "synthetic",
           "--num-classes", "10", "--image-size", str(args.image_size), "-b", str(args.batch),
           "--synthetic-size", str(args.batch * 64), "--max-steps", "1", "--epochs", "1",
           "--no-progress", "--workers", "0", "--auto-steps", str(args.rounds), "--out", out,
           "--overwrite"]
    first = _launch(net, job, port)
    with open(os.path.join(net.dirs[0], out, "config.json")) as f:
        config = json.load(f)
    record = config["resolved"]["auto"]
    resumed = _launch(net, ["train", "--resume", out, "--strategy", "auto", "--max-steps", "2",
                            "--no-progress"], port + 1)
    kept = (f"already has --strategy {record['choice']} (chosen by its race)" in resumed
            and RACE_BLOCK not in resumed)
    medians = {row["name"]: row.get("median_s") for row in record["table"]}
    return {"arch": arch, "choice": record["choice"], "strategy": config["parallel"]["strategy"],
            "reason": record["reason"], "medians": medians,
            "planned_mb": {k: v / 1e6 for k, v in record["planned_bytes"].items()},
            "link_mbit": record["link_bytes_per_s"] * 8 / 1e6, "raced_once": RACE_BLOCK in first,
            "resume_kept_it_without_a_race": kept}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="alexnet,resnet18")
    p.add_argument("--rate", default="100mbit")
    p.add_argument("--rounds", type=int, default=3, help="--auto-steps: the race's rounds")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    why = unavailable()
    if why:
        raise SystemExit(f"two_machine_auto.py: {why}")
    rows = []
    with tempfile.TemporaryDirectory() as root, TwoMachines(root) as net:
        net.shape(args.rate)
        port = 29700
        for arch in args.arch.split(","):
            rows.append(_pick(net, arch, args, port))
            port += 2
    print(f"| model | link ({args.rate}) | ddp step s | hybrid-ddp step s | planned MB ddp / "
          f"hybrid | choice | resume kept it, no race |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        m, mb = r["medians"], r["planned_mb"]
        print(f"| {r['arch']} | {r['link_mbit']:.0f} Mbit/s measured | {m.get('ddp', 0):.2f} | "
              f"{m.get('hybrid-ddp', 0):.2f} | {mb.get('ddp', 0):.0f} / "
              f"{mb.get('hybrid-ddp', 0):.0f} | {r['choice']} | "
              f"{'yes' if r['resume_kept_it_without_a_race'] else 'NO'} |")
    for r in rows:
        print(f"{r['arch']}: {r['reason']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
