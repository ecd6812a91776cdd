"""Elastic: `tandem launch --nnodes 1:3` on three network namespaces on a bridge
(tests/support/two_machines.py), each with its own directory. The job starts on two nodes, a
third joins mid-run (it has no run directory: rank 0's checkpoint is sent to it) and leaves by
SIGTERM; each change is one line on rank 0 and costs no completed step. The final weights are
bitwise those of a run that made the same changes at the same steps (2, then 3, then 2
processes, stopped and resumed there), and equal to single's straight run in float64.

Needs root and iproute2 (skipped elsewhere, with the reason); every process is ended by its pid
and the namespaces are deleted, also when the test fails.
"""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import cli_env
from two_machines import ADDRS, Machines, unavailable

pytestmark = [pytest.mark.slow, pytest.mark.distributed,
              pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))]

TANDEM = [sys.executable, "-m", "tandem"]
# 96 synthetic samples in global batches of 6: 16 steps an epoch, 32 in all; drop path on
# (keyed: each sample's mask does not depend on the process it runs in)
JOB = ["train", "--strategy", "ddp", "--devices", "cpu", "--data", "synthetic",
       "--synthetic-size", "96", "--image-size", "8", "--num-classes", "3", "-b", "6",
       "--epochs", "2", "--seed", "5", "--no-progress", "--dtype", "float64",
       "--drop-path", "0.1", "--sync-bn", "--save-every", "2"]
STEPS = 32
PORT = 29720
CHANGE = re.compile(r"^\s*node (\S+) (joined|left): (\d) nodes, (\d) processes; continuing "
                    r"from step (\d+) \(the change cost no completed step\)$", re.M)


def elastic_argv():
    return [*TANDEM, "launch", "--nnodes", "1:3", "--nproc-per-node", "1", "--rdzv-endpoint",
            f"{ADDRS[0]}:{PORT}", "--rdzv-id", "elastic7", "--rdzv-conf",
            "last_call_timeout=4", "--max-restarts", "2", "--", *JOB, "--out", "runs/job"]


def saved_step(directory):
    """The step of the checkpoint in ``directory`` (-1: none yet, or being replaced)."""
    try:
        return torch.load(os.path.join(directory, "runs/job/checkpoint.pt"),
                          weights_only=True)["data_position"]["step"]
    except Exception:
        return -1


def wait_until(test, what, procs, bound=150):
    started = time.monotonic()
    while not test():
        dead = [p.returncode for p in procs if p.poll() is not None]
        assert not dead, f"a node ended ({dead}) while waiting for {what}"
        assert time.monotonic() - started < bound, f"no {what} within {bound} s"
        time.sleep(0.2)


def run_local(argv, env):
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def weights(path):
    return torch.load(path, weights_only=True)["state_dict"]


def test_two_nodes_gain_a_third_and_lose_it_and_stay_the_same_run(tmp_path, request):
    # single's straight run of the same 32 steps, and a control one step short of it: on this
    # machine, while the elastic job mostly waits on its slowed steps
    local = cli_env()
    single = [*TANDEM, *JOB[:2], "single", *(a for a in JOB[3:] if a != "--sync-bn")]
    singles = [subprocess.Popen([*single, "--out", str(tmp_path / name), *flags], env=local,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
               for name, flags in (("single", []), ("short", ["--max-steps", str(STEPS - 1)]))]
    request.addfinalizer(lambda: [p.kill() for p in singles if p.poll() is None])
    env = cli_env(TANDEM_SLOW_STEP="0.3")
    with Machines(tmp_path / "elastic", nodes=3) as net:
        logs = [open(tmp_path / f"node{i}.log", "w+") for i in range(3)]

        def start(node):
            return net.start(node, elastic_argv(), env, stdout=logs[node],
                             stderr=subprocess.STDOUT)

        def said(node):
            logs[node].flush()
            with open(tmp_path / f"node{node}.log") as f:
                return f.read()

        # node 1 waits for the endpoint, so both are there when node 0 opens the rendezvous
        nodes = [None, start(1)]
        time.sleep(1.0)
        nodes[0] = start(0)
        wait_until(lambda: saved_step(net.dirs[0]) >= 4, "step 4 on two nodes", nodes)
        nodes.append(start(2))
        wait_until(lambda: "joined" in said(0), "the third node's join", nodes)
        joined_at = int(CHANGE.search(said(0)).group(5))
        wait_until(lambda: saved_step(net.dirs[0]) >= joined_at + 4, "4 steps on three nodes",
                   nodes)
        nodes[2].send_signal(signal.SIGTERM)  # its launcher: the node leaves
        codes = [p.wait(timeout=240) for p in nodes]
        out = [said(i) for i in range(3)]
        assert codes == [0, 0, 128 + signal.SIGTERM], "\n\n".join(o[-3000:] for o in out)
        for text in out:
            assert "Traceback" not in text, text[-3000:]
        changes = CHANGE.findall(out[0])
        assert [(a, how, n, p) for a, how, n, p, _ in changes] == [
            (ADDRS[2], "joined", "3", "3"), (ADDRS[2], "left", "2", "2")], out[0][-3000:]
        (_, _, _, _, joined), (_, _, _, _, left) = changes
        first, second = int(joined), int(left)
        assert 4 <= first < second < STEPS
        # the newcomer had no run directory: rank 0's checkpoint was sent to it
        assert (f"rank 2 (node 2, {ADDRS[2]}): runs/job/checkpoint.pt is not on this machine; "
                f"using rank 0's") in out[2]
        # the workers stopped for a change say the launcher goes on (the command is for a stop)
        assert "rank 0 saved runs/job/checkpoint.pt at epoch " in out[1]
        assert "if the job's nodes changed, the launcher goes on from it; else continue" in out[1]
        # only rank 0 writes: the leaving node saved nothing of its own, nor did node 1
        assert os.listdir(net.dirs[1]) == [] and os.listdir(net.dirs[2]) == []
        assert f"best val acc" in out[0]
        final = weights(os.path.join(net.dirs[0], "runs/job/checkpoint.pt"))
        assert saved_step(net.dirs[0]) == STEPS

    # the same changes at the same steps, on one machine: 2 processes, then 3, then 2
    ref = str(tmp_path / "ref")
    for procs, flags in ((2, ["--max-steps", str(first)]),
                         (3, ["--resume", ref, "--max-steps", str(second)]),
                         (2, ["--resume", ref])):
        run_local([*TANDEM, "launch", "--nproc-per-node", str(procs), "--", *JOB, "--out", ref,
                   *flags], local)
    same_changes = weights(os.path.join(ref, "checkpoint.pt"))
    assert final.keys() == same_changes.keys()
    for key in final:
        assert torch.equal(final[key], same_changes[key]), key

    for proc in singles:
        _, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-3000:]
    straight = weights(str(tmp_path / "single/checkpoint.pt"))
    short = weights(str(tmp_path / "short/checkpoint.pt"))

    def farthest(a, b):
        return max((a[k].double() - b[k].double()).abs().max().item() for k in a
                   if a[k].is_floating_point())

    # float64: the processes' sums round apart from single's by about 1e-15; one step is 1e-3
    assert farthest(final, straight) < 1e-9
    assert farthest(short, straight) > 1e-4
