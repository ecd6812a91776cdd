"""Many ranks on one box: join time, the job store's requests and a killed rank, by rank count.

For each rank count W (2, 4, 8, 16), W ddp workers of a tiny job (cifar_resnet20 at 8 px, 256
synthetic samples in global batches of 32: 8 steps) run as 4 network namespaces of W/4
processes each (2 of 1 for W = 2), on a bridge (tests/support/two_machines.py's Machines; needs
root and iproute2). Four jobs a rank count, one after another:

- straight through: the join time (the launchers started to node 0's line for step 1) and what
  node 0's store port (--master-port: torchrun's store, which the workers share) received,
  counted on the wire by tc at both of its paths in (node 0's loopback, the bridge's port
  towards node 0): requests (segments ending a write, one a store request) and connections,
  up to step 1, over steps 2..8 (per step), and after step 8 (validation, save, exit);
- the last rank SIGKILLed at step 5 (tests/support/child_hooks' TANDEM_INJECT_FAULT): the
  time from its fault line to every node's exit, and whether each survivor's node said one
  line; then the command node 0's line gives every node, and whether the run it finishes is
  bitwise the straight run (the checkpoint's weights, buffers and optimizer state);
- the same kill under ``--max-restarts 1``: whether it finishes by itself, and bitwise.

Run as root (about 20 minutes on a 2-core machine)::

    python benchmarks/many_ranks.py --json runs/bench/many_ranks.json
    python benchmarks/many_ranks.py --ranks 2,4          # a quick look
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(HERE, "..", "tests")
# conftest's environment, tests/support's harness and the two-machine tests' line parsing
for _folder in ("", "support", os.path.join("integration", "two_machines")):
    sys.path.insert(0, os.path.join(TESTS, _folder))

import torch  # noqa: E402
from conftest import cli_env  # noqa: E402
from test_two_machines import TANDEM, continue_commands, told  # noqa: E402
from two_machines import ADDRS, Machines, unavailable  # noqa: E402

STEPS, KILL_AT = 8, 5
JOB = ["train", "--strategy", "ddp", "--devices", "cpu", "-a", "cifar_resnet20",
       "--data", "synthetic", "--synthetic-size", "256", "--image-size", "8",
       "--num-classes", "10", "-b", "32", "--epochs", "1", "--seed", "5", "--workers", "0",
       "--no-progress", "-p", "1"]
_STEP_LINE = re.compile(r"^epoch 1/1 \[(\d+)/\d+\] loss")
#: the heartbeat watchdog tandem had until 2692656: every 5 s each rank made one connection and
#: W + 1 requests (a set, a check of each other rank's key, a multi_get) on node 0's store
OLD_BEAT_S = 5.0


def layout(ranks: int) -> tuple[int, int]:
    """(nodes, processes a node): 4 nodes from 4 ranks up, else 2 nodes of 1."""
    if ranks == 2:
        return 2, 1
    if ranks < 4 or ranks % 4:
        raise SystemExit(f"many_ranks.py: --ranks {ranks}: expected 2 or a multiple of 4")
    return 4, ranks // 4


class Job:
    """The launchers of one job, one a node, started together: their lines, with the time
    each was read, and the time each node's launcher exited. ``on_step(step)`` runs in node
    0's reader when its line for a training step arrives."""

    def __init__(self, net, argvs: list[list[str]], env: dict, on_step=None):
        self.on_step = on_step
        self.lines: list[list[tuple[float, str, str]]] = [[] for _ in argvs]
        self.started = time.monotonic()
        self.procs = [net.start(n, argv, env) for n, argv in enumerate(argvs)]
        self._readers = [threading.Thread(target=self._read, args=(n, stream, name),
                                          daemon=True)
                         for n, proc in enumerate(self.procs)
                         for stream, name in ((proc.stdout, "out"), (proc.stderr, "err"))]
        for reader in self._readers:
            reader.start()

    def _read(self, node: int, stream, name: str) -> None:
        for line in stream:
            now = time.monotonic()
            self.lines[node].append((now, name, line.rstrip("\n")))
            step = _STEP_LINE.match(line) if node == 0 and name == "out" else None
            if step and self.on_step:
                self.on_step(int(step.group(1)), now)

    def wait(self, timeout: float) -> list[float]:
        """Each node's exit time (seconds since the start); past ``timeout``, SystemExit."""
        ended: dict[int, float] = {}
        deadline = time.monotonic() + timeout
        while len(ended) < len(self.procs):
            for n, proc in enumerate(self.procs):
                if n not in ended and proc.poll() is not None:
                    ended[n] = time.monotonic()
            if time.monotonic() > deadline:
                raise SystemExit(f"many_ranks.py: a job did not end within {timeout:.0f} s; "
                                 f"node 0 said: {self.text(0)[-2000:]}")
            time.sleep(0.05)
        for reader in self._readers:
            reader.join(timeout=30)
        return [ended[n] for n in range(len(self.procs))]

    @property
    def codes(self) -> list[int]:
        return [proc.returncode for proc in self.procs]

    def text(self, node: int, stream: str = "err") -> str:
        return "\n".join(line for _, name, line in self.lines[node] if name == stream)

    def first(self, pattern: str) -> float | None:
        """When a line of any node first matched ``pattern``."""
        hits = [t for node in self.lines for t, _, line in node if re.search(pattern, line)]
        return min(hits) if hits else None


def _launch(nodes: int, per_node: int, port: int, *flags: str, out: str) -> list[list[str]]:
    return [[*TANDEM, "launch", "--nnodes", str(nodes), "--nproc-per-node", str(per_node),
             "--node-rank", str(n), "--master-addr", ADDRS[0], "--master-port", str(port),
             "--join-timeout", "600", "--dist-timeout", "120", *flags, "--", *JOB,
             "--out", out] for n in range(nodes)]


def _state(path: str) -> dict:
    saved = torch.load(path, weights_only=True)
    return {"state_dict": saved["state_dict"], "optimizer": saved["optimizer"]}


def _tensors(state, path: str = "") -> dict:
    """Every tensor (and plain value) of a nested state, by its path."""
    if isinstance(state, dict):
        return {k: v for key in state for k, v in _tensors(state[key], f"{path}/{key}").items()}
    if isinstance(state, (list, tuple)):
        return {k: v for i, x in enumerate(state) for k, v in _tensors(x, f"{path}/{i}").items()}
    return {path: state}


def compared(a: dict, b: dict) -> str:
    """``bitwise``, or how many of the tensors differ and by how much at most."""
    ta, tb = _tensors(a), _tensors(b)
    if ta.keys() != tb.keys():
        return "NO (other keys)"
    differ = [k for k in ta if not (torch.equal(ta[k], tb[k]) if isinstance(ta[k], torch.Tensor)
                                    else ta[k] == tb[k])]
    if not differ:
        return "bitwise"
    worst = max(float((ta[k].double() - tb[k].double()).abs().max()) for k in differ
                if isinstance(ta[k], torch.Tensor) and ta[k].is_floating_point())
    return f"{len(differ)} of {len(ta)} differ, by {worst:.0e} at most"


def _straight(net, nodes: int, per_node: int, port: int) -> dict:
    """The job straight through, its store's traffic counted at step 1 and at the last."""
    net.count_to(0, port)
    seen: dict[int, tuple[float, object]] = {}

    def on_step(step: int, when: float) -> None:
        if step in (1, STEPS):
            seen[step] = (when, net.counted())

    job = Job(net, _launch(nodes, per_node, port, out="runs/straight"), cli_env(), on_step)
    ended = job.wait(1800)
    total = net.counted()
    if any(job.codes) or 1 not in seen or STEPS not in seen:
        raise SystemExit(f"many_ranks.py: the straight run failed ({job.codes}): "
                         f"{job.text(0)[-2000:]}")
    (t1, at1), (tn, atn) = seen[1], seen[STEPS]
    noise = [sum("[c10d]" in line and "err=-3" not in line for line in job.text(n).splitlines())
             for n in range(nodes)]
    return {"join_s": t1 - job.started, "wall_s": max(ended) - job.started, "c10d_lines": noise,
            "join_requests": at1.requests, "join_connections": at1.connections,
            "step_requests": (atn.requests - at1.requests) / (STEPS - 1),
            "step_connections": (atn.connections - at1.connections) / (STEPS - 1),
            "end_requests": (total - atn).requests, "total_requests": total.requests,
            "total_bytes": total.bytes}


def _survivor_lines(job: Job, node: int) -> list[str]:
    """What a node said on stderr besides torch's reverse-lookup note and the fault's own
    line."""
    return [line for line in told(job.text(node)) if "injected fault" not in line]


def _killed(net, nodes: int, per_node: int, port: int, straight: dict) -> dict:
    """The last rank SIGKILLed at step KILL_AT; then every node's command to continue."""
    ranks = nodes * per_node
    env = cli_env(TANDEM_INJECT_FAULT=f"{ranks - 1}:{KILL_AT}:kill")
    job = Job(net, _launch(nodes, per_node, port, out="runs/killed"), env)
    ended = job.wait(1800)
    hit = job.first(r"injected fault on rank")
    if hit is None:
        raise SystemExit(f"many_ranks.py: the fault did not fire: {job.text(nodes - 1)[-2000:]}")
    said = [_survivor_lines(job, n) for n in range(nodes)]
    commands = continue_commands(" ".join(said[0]))
    row = {"noticed_s": max(ended) - hit, "noticed_node0_s": ended[0] - hit,
           "killed_codes": job.codes, "said": said, "resumed": None}
    if sorted(commands) != list(range(nodes)):
        return row
    started = time.monotonic()
    resume = Job(net, [commands[n] for n in range(nodes)], cli_env())
    resume.wait(1800)
    row["resume_s"] = time.monotonic() - started
    row["resume_codes"] = resume.codes
    row["resume_said"] = [told(resume.text(n))[-3:] for n in range(nodes)]
    row["resumed"] = ("NO (exit " + ", ".join(map(str, resume.codes)) + ")" if any(resume.codes)
                      else compared(_state(os.path.join(net.dirs[0], "runs/killed/checkpoint.pt")),
                                    straight["state"]))
    return row


def _restarted(net, nodes: int, per_node: int, port: int, straight: dict) -> dict:
    """The same kill under --max-restarts 1: the job finishes by itself, bitwise or not."""
    ranks = nodes * per_node
    env = cli_env(TANDEM_INJECT_FAULT=f"{ranks - 1}:{KILL_AT}:kill")
    job = Job(net, _launch(nodes, per_node, port, "--max-restarts", "1", out="runs/restarted"),
              env)
    ended = job.wait(1800)
    path = os.path.join(net.dirs[0], "runs/restarted/checkpoint.pt")
    done = not any(job.codes) and os.path.isfile(path)
    return {"restart_s": max(ended) - job.started, "restart_codes": job.codes,
            "restart_said": [told(job.text(n))[-4:] for n in range(nodes)],
            "restarted": (compared(_state(path), straight["state"]) if done else
                          "NO (exit " + ", ".join(map(str, job.codes)) + ")")}


def measure(ranks: int, root: str, port: int) -> dict:
    nodes, per_node = layout(ranks)
    with Machines(os.path.join(root, f"w{ranks}"), nodes=nodes, bridge=True) as net:
        row = {"ranks": ranks, "nodes": nodes, "per_node": per_node}
        row.update(_straight(net, nodes, per_node, port))
        straight = {"state": _state(os.path.join(net.dirs[0], "runs/straight/checkpoint.pt"))}
        row.update(_killed(net, nodes, per_node, port + 1, straight))
        row.update(_restarted(net, nodes, per_node, port + 2, straight))
    row["old_beat_requests"] = ranks * (ranks + 1)
    return row


def growth(rows: list[dict], key: str) -> float | None:
    """k in ``value ~ ranks**k``: the least-squares slope of log(value) on log(ranks)."""
    points = [(math.log(r["ranks"]), math.log(r[key])) for r in rows if r.get(key, 0) > 0]
    if len(points) < 2:
        return None
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    return (sum((x - mx) * (y - my) for x, y in points)
            / sum((x - mx) ** 2 for x, _ in points))


def _lines(said: list[str]) -> str:
    """``tandem's lines (+ torch's [c10d] warnings)`` of one node's stderr."""
    ours = sum(line.startswith("tandem") for line in said)
    torch_said = sum("[c10d]" in line for line in said)
    return f"{ours}" + (f" (+{torch_said})" if torch_said else "")


def table(rows: list[dict]) -> str:
    head = ("| ranks (nodes x processes) | join s | store requests to step 1 (connections) "
            "| requests / step | requests after the last step | old watchdog: requests / 5 s "
            "beat | killed rank noticed, every node out (node 0) | lines a node, the killed "
            "rank's last (+ torch's) | resume "
            "| --max-restarts 1 |\n|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['ranks']} ({r['nodes']} x {r['per_node']}) | {r['join_s']:.1f} | "
            f"{r['join_requests']} ({r['join_connections']}) | {r['step_requests']:.1f} | "
            f"{r['end_requests']} | {r['old_beat_requests']} | {r['noticed_s']:.1f} s "
            f"({r['noticed_node0_s']:.1f} s) | {', '.join(_lines(n) for n in r['said'])} | "
            f"{r['resumed'] or '?'} | {r['restarted']} ({r['restart_s']:.0f} s) |")
    fits = [(name, growth(rows, key)) for name, key in
            (("join s", "join_s"), ("store requests to step 1", "join_requests"),
             ("connections to step 1", "join_connections"), ("noticed", "noticed_s"))]
    lines.append("")
    lines.append("Growth with the rank count W (least-squares k in W^k): " + ", ".join(
        f"{name} W^{k:.2f}" for name, k in fits if k is not None))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="2,4,8,16", help="rank counts, comma-separated")
    p.add_argument("--port", type=int, default=29700, help="the first --master-port")
    p.add_argument("--json", default=None)
    p.add_argument("--table-from", default=None, metavar="JSON",
                   help="print the table of an earlier run's --json, and run nothing")
    args = p.parse_args(argv)
    if args.table_from:
        with open(args.table_from) as f:
            print(table(json.load(f)))
        return 0
    counts = [int(w) for w in args.ranks.split(",")]
    for ranks in counts:
        layout(ranks)  # a bad count is told before anything starts
    why = unavailable()
    if why:
        raise SystemExit(f"many_ranks.py {why}")
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for i, ranks in enumerate(counts):
            started = time.monotonic()
            rows.append(measure(ranks, root, args.port + 3 * i))
            print(f"many_ranks.py: {ranks} ranks measured in {time.monotonic() - started:.0f} s: "
                  f"{json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    print(table(rows), flush=True)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
