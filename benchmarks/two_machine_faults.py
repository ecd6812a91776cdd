"""What each node of a two-node ddp job prints when a fault hits it, and how long it takes.

Two network namespaces joined by a veth pair (tests/support/two_machines.py; needs root and
iproute2). Each fault is injected into rank 1 at its 9th training step
(tests/support/child_hooks/faults.py); the time to notice runs from the fault's own line on node 1
to each node's exit. Then every node runs the command it was given (or the job ends by itself), and
the final weights are compared with the same job run straight through. Run as root::

    python benchmarks/two_machine_faults.py
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(HERE, "..", "tests")
# conftest's helpers, tests/support's harness and the two-machine tests' job
for _folder in ("", "support", os.path.join("integration", "two_machines")):
    sys.path.insert(0, os.path.join(TESTS, _folder))

import torch  # noqa: E402
from conftest import cli_env  # noqa: E402
from test_two_machines import JOB, continue_commands, launch_argv, told  # noqa: E402
from two_machines import TwoMachines  # noqa: E402

FAULTS = [("kill -9 of rank 1", "1:9:kill", []),
          ("partition (node 1's link down)", "1:9:partition", ["--dist-timeout", "20"]),
          ("Ctrl-C on node 1", "1:9:interrupt", []),
          ("kill -9 of rank 1, --max-restarts 2", "1:9:kill", ["--max-restarts", "2"])]


def _timed(proc, lines: list) -> threading.Thread:
    def read():
        for line in proc.stderr:
            lines.append((time.monotonic(), line.rstrip("\n")))
    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def _both(net, argvs, env):
    procs = [net.start(n, argv, env) for n, argv in enumerate(argvs)]
    lines = [[], []]
    readers = [_timed(p, lines[n]) for n, p in enumerate(procs)]
    ended = []
    for proc, reader in zip(procs, readers):
        proc.wait(timeout=600)
        ended.append(time.monotonic())
        reader.join(timeout=10)
    return procs, lines, ended


def _weights(path):
    return torch.load(path, weights_only=True)["state_dict"]


def main() -> None:
    with tempfile.TemporaryDirectory() as root:
        with TwoMachines(os.path.join(root, "straight")) as net:
            procs, _, _ = _both(net, [launch_argv(n, 29900) for n in (0, 1)], cli_env())
            straight = _weights(os.path.join(net.dirs[0], "runs/job/checkpoint.pt"))
        print("| fault | node 0 printed | node 1 printed | noticed after (node 0, node 1) "
              "| steps lost | resume exact |")
        print("|---|---|---|---|---|---|")
        for i, (name, fault, flags) in enumerate(FAULTS):
            with TwoMachines(os.path.join(root, f"f{i}")) as net:
                port = 29902 + 2 * i
                procs, lines, ended = _both(net, [launch_argv(n, port, *flags) for n in (0, 1)],
                                            cli_env(TANDEM_INJECT_FAULT=fault))
                hit = next(t for t, line in lines[1] if "injected fault" in line)
                said = [[x for x in told("\n".join(line for _, line in node))
                         if not x.startswith("tandem: injected")] for node in lines]
                commands = continue_commands(" ".join(said[0]))
                net.mend(1)  # the partition's link comes back before the resume
                if commands:
                    _both(net, [commands[0], commands[1]], cli_env())
                ckpt = torch.load(os.path.join(net.dirs[0], "runs/job/checkpoint.pt"),
                                  weights_only=True)
                exact = all(torch.equal(ckpt["state_dict"][k], straight[k]) for k in straight)
                cut = re.search(r"step (\d+)", " ".join(said[0]))
                lost = "0 (the step in flight is redone)" if cut else "?"
                shown = [" / ".join(s) or "(nothing)" for s in said]
                print(f"| {name} | `{shown[0]}` (exit {procs[0].returncode}) | `{shown[1]}` "
                      f"(exit {procs[1].returncode}) | {ended[0] - hit:.1f} s, "
                      f"{ended[1] - hit:.1f} s | {lost} | {'bitwise' if exact else 'NO'} |",
                      flush=True)


if __name__ == "__main__":
    main()
