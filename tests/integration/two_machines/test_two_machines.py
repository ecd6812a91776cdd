"""Two machines for real: `tandem launch` on two network namespaces joined by a veth pair
(tests/support/two_machines.py), each node with its own directory (no shared disk) and its host name
resolving to 127.0.0.1. Compared with the same two-node job run straight through: a killed
worker, a partition, a restart and a Ctrl-C each end in one line per node and resume (or
finish) bitwise equal to it, with node 1's directory empty.

Needs root and iproute2 (skipped elsewhere, with the reason); every process is ended by its pid
and the namespaces are deleted, also when a test fails.
"""

import os
import re
import sys

import pytest
import torch
from conftest import cli_env
from two_machines import ADDRS, TwoMachines, unavailable

pytestmark = [pytest.mark.slow, pytest.mark.distributed,
              pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))]

# 64 synthetic samples in global batches of 4: one epoch of 16 steps over 2 ranks
JOB = ["train", "--strategy", "ddp", "--devices", "cpu", "--data", "synthetic",
       "--synthetic-size", "64", "--image-size", "8", "--num-classes", "3", "-b", "4",
       "--epochs", "1", "--seed", "5", "--no-progress"]
TANDEM = [sys.executable, "-m", "tandem"]
_ports = iter(range(29610, 29700))


# rank 0 writes its checkpoints off the step's path, so a loaded machine's slow fsync could
# leave step 4's unwritten when rank 0 is killed at step 9: each step slowed by 0.5 s (a test
# hook) gives the writer 2.5 s, and the tests also accept, with its true lines, a disk that
# holds none
_WRITE_TIME = {"TANDEM_SLOW_STEP": "0.5"}


def launch_argv(node: int, port: int, *flags, job=JOB, out="runs/job"):
    return [*TANDEM, "launch", "--nnodes", "2", "--nproc-per-node", "1", "--node-rank",
            str(node), "--master-addr", ADDRS[0], "--master-port", str(port), *flags, "--",
            *job, "--out", out]


def run_both(net, argvs, env=None, timeout=240):
    """Start ``argvs[i]`` on node i together; their (returncode, stdout, stderr)."""
    envs = env if isinstance(env, list) else [env or cli_env()] * 2
    procs = [net.start(node, argv, envs[node]) for node, argv in enumerate(argvs)]
    done = []
    for proc in procs:
        out, err = proc.communicate(timeout=timeout)
        done.append((proc.returncode, out, err))
    return done


def told(stderr: str) -> list[str]:
    """stderr without torch's reverse-lookup note, which the launcher explains once."""
    return [line for line in stderr.splitlines() if "err=-3" not in line]


def weights(path):
    return torch.load(path, weights_only=True)["state_dict"]


def assert_bitwise_equal(a, b):
    sa, sb = weights(a), weights(b)
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def continue_commands(line: str) -> dict[int, list[str]]:
    """{node: argv} of the per-node commands a line gives (``on node R: tandem launch ...``)."""
    found = re.findall(r"on node (\d+): tandem (launch [^;]+)", line)
    return {int(node): [*TANDEM, *command.split()] for node, command in found}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The job run straight through, launched with the launch flags alone."""
    root = tmp_path_factory.mktemp("straight")
    with TwoMachines(root) as net:
        port = next(_ports)
        results = run_both(net, [launch_argv(n, port) for n in (0, 1)])
        return net.dirs, results


def test_launch_flags_alone_start_the_job_and_only_node_0_writes(straight):
    dirs, results = straight
    for node, (code, out, err) in enumerate(results):
        assert code == 0, err[-3000:]
        assert "Traceback" not in err
        assert re.search(rf"^tandem launch: node {node}: the workers talk through \S+ "
                         rf"\({ADDRS[node]}\)", out, re.M), out
    assert "best val acc" in results[0][1]
    assert os.path.isfile(os.path.join(dirs[0], "runs/job/checkpoint.pt"))
    assert os.listdir(dirs[1]) == []  # no shared disk: rank 0 alone writes


def test_killed_worker_on_node_1_ends_node_0_in_one_line_and_resumes_bitwise(straight,
                                                                             tmp_path):
    fault = cli_env(TANDEM_INJECT_FAULT="1:9:kill")
    with TwoMachines(tmp_path) as net:
        port = next(_ports)
        (code0, _, err0), (code1, _, err1) = run_both(
            net, [launch_argv(n, port) for n in (0, 1)], fault)
        lines = told(err0)
        assert code0 == 4 and len(lines) == 1, err0[-3000:]
        assert re.match(r"tandem: error: rank 0 \(node 0, 192\.0\.2\.1\): lost rank 1 \(node 1, "
                        r"192\.0\.2\.2\) in step 9: connection (reset|closed) by peer", lines[0])
        assert "saved runs/job/checkpoint.pt at epoch 1, step 8" in lines[0]
        assert code1 == 128 + 9 and told(err1)[-1].startswith("tandem launch: rank 1 "), err1
        saved = torch.load(os.path.join(net.dirs[0], "runs/job/checkpoint.pt"),
                           weights_only=True)
        assert saved["data_position"]["step"] == 8
        assert os.listdir(net.dirs[1]) == []
        commands = continue_commands(lines[0])
        assert sorted(commands) == [0, 1]
        resumed = run_both(net, [commands[0], commands[1]])
        for code, out, err in resumed:
            assert code == 0, err[-3000:]
        assert "resuming runs/job/checkpoint.pt at epoch 1/1, step 8" in resumed[0][1]
        assert "runs/job/checkpoint.pt is not on this machine; using rank 0's" in resumed[1][2]
        assert os.listdir(net.dirs[1]) == []
        assert_bitwise_equal(os.path.join(net.dirs[0], "runs/job/checkpoint.pt"),
                             os.path.join(straight[0][0], "runs/job/checkpoint.pt"))


def test_partition_past_dist_timeout_ends_both_nodes_in_one_line_and_resumes_bitwise(
        straight, tmp_path):
    fault = cli_env(TANDEM_INJECT_FAULT="1:9:partition")
    with TwoMachines(tmp_path) as net:
        port = next(_ports)
        results = run_both(net, [launch_argv(n, port, "--dist-timeout", "10")
                                 for n in (0, 1)], fault)
        for node, (code, _, err) in enumerate(results):
            lines = [x for x in told(err) if not x.startswith("tandem: injected")]
            assert code == 4 and len(lines) == 1, err[-3000:]
            other = 1 - node
            assert re.match(rf"tandem: error: rank {node} \(node {node}, {ADDRS[node]}\): lost "
                            rf"rank {other} \(node {other}, {ADDRS[other]}\) in step 9: no answer",
                            lines[0]), lines[0]
        assert "saved runs/job/checkpoint.pt at epoch 1, step 8" in told(results[0][2])[0]
        net.mend(1)
        # node 1 holds a stale copy of the run: rank 0's is used, and node 1 says so
        os.makedirs(os.path.join(net.dirs[1], "runs/job"))
        with open(os.path.join(net.dirs[1], "runs/job/checkpoint.pt"), "wb") as f:
            f.write(b"an older copy")
        commands = continue_commands(told(results[0][2])[0])
        resumed = run_both(net, [commands[0], commands[1]])
        for code, out, err in resumed:
            assert code == 0, err[-3000:]
        assert ("rank 1 (node 1, 192.0.2.2): runs/job/checkpoint.pt differs from rank 0's; "
                "using rank 0's" in resumed[1][2]), resumed[1][2]
        assert_bitwise_equal(os.path.join(net.dirs[0], "runs/job/checkpoint.pt"),
                             os.path.join(straight[0][0], "runs/job/checkpoint.pt"))


def test_max_restarts_with_a_killed_worker_under_slurm_finishes_bitwise(straight, tmp_path):
    """Launched from SLURM's variables (the node list's first host is the master), restarted
    by torchrun after node 1's worker is killed: node 1 has no run directory and gets rank
    0's checkpoint; the run ends equal to the straight one."""
    job = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "192.0.2.[1-2]"}
    envs = [cli_env(TANDEM_INJECT_FAULT="1:9:kill", SLURM_NODEID=str(n), **job) for n in (0, 1)]
    argv = [*TANDEM, "launch", "--nproc-per-node", "1", "--max-restarts", "2", "--", *JOB,
            "--out", "runs/job"]
    with TwoMachines(tmp_path) as net:
        results = run_both(net, [argv, argv], envs)
        for node, (code, out, err) in enumerate(results):
            assert code == 0, err[-3000:]
            assert (f"tandem launch: SLURM job 4242: node {node} of 2, master 192.0.2.1:19242"
                    in out), out
        assert "(torchrun restart 1)" in results[0][1]
        assert os.listdir(net.dirs[1]) == []
        assert_bitwise_equal(os.path.join(net.dirs[0], "runs/job/checkpoint.pt"),
                             os.path.join(straight[0][0], "runs/job/checkpoint.pt"))


def test_ctrl_c_on_node_1_stops_both_saves_and_each_node_gets_its_command(straight, tmp_path):
    fault = cli_env(TANDEM_INJECT_FAULT="1:5:interrupt")
    with TwoMachines(tmp_path) as net:
        port = next(_ports)
        (code0, _, err0), (code1, _, err1) = run_both(
            net, [launch_argv(n, port) for n in (0, 1)], fault)
        assert code0 == code1 == 130, (err0[-2000:], err1[-2000:])
        [line0] = [x for x in told(err0) if x.startswith("tandem: interrupted")]
        # Ctrl-C in step 5 on node 1 alone: the ranks' vote stops both one step later
        assert re.search(r"saved runs/job/checkpoint.pt at epoch 1, step [67];", line0), line0
        assert len(told(err0)) == 1, err0  # the launcher adds nothing to the worker's line
        [line1] = [x for x in told(err1) if x.startswith("tandem: interrupted")]
        own = continue_commands(line1)
        assert list(own) == [1] and own[1] == continue_commands(line0)[1], line1
        commands = continue_commands(line0)
        for code, out, err in run_both(net, [commands[0], commands[1]]):
            assert code == 0, err[-3000:]
        assert_bitwise_equal(os.path.join(net.dirs[0], "runs/job/checkpoint.pt"),
                             os.path.join(straight[0][0], "runs/job/checkpoint.pt"))


def test_a_node_whose_peers_never_come_ends_in_one_line(tmp_path):
    with TwoMachines(tmp_path) as net:
        port = next(_ports)
        for node in (0, 1):
            proc = net.start(node, launch_argv(node, port, "--join-timeout", "4"), cli_env())
            out, err = proc.communicate(timeout=120)
            lines = told(err)
            assert proc.returncode == 4 and len(lines) == 1, err[-3000:]
            assert "Traceback" not in err
            if node == 0:
                assert lines[0] == (
                    f"tandem launch: node 0: the nodes did not meet at 192.0.2.1:{port} within "
                    "4 s: 1 of 2 nodes here (is every node started with the same --nnodes, "
                    "--master-addr and --master-port?)")
            else:
                assert lines[0].startswith(
                    f"tandem: error: node 1: node 0 did not answer at 192.0.2.1:{port} within "
                    "4 s (connection refused)")


def test_a_rank_that_gives_the_others_its_loopback_address_ends_every_node_in_one_line(
        tmp_path):
    """GLOO_SOCKET_IFNAME=lo, set by hand (tandem launch keeps a user's setting): a rank
    advertises 127.0.0.1; the one that cannot connect says why with the real elapsed time, and
    the other stops at once instead of waiting out the 300 s connect timeout."""
    with TwoMachines(tmp_path) as net:
        port = next(_ports)
        results = run_both(net, [launch_argv(n, port) for n in (0, 1)],
                           cli_env(GLOO_SOCKET_IFNAME="lo"), timeout=120)
    last = []
    for code, out, err in results:
        assert code == 4 and "Traceback" not in err, err[-3000:]
        last.append(told(err)[-1])
    assert any(re.search(r"rank \d: every rank came to 192\.0\.2\.1:\d+, but "
                        r"the gloo connections failed after \d+\.\d s: connection refused "
                        r"\(127\.0\.0\.1:\d+\); a rank gave its loopback address", line)
               for line in last), last
    assert all(line.startswith("tandem: error: rank ") for line in last), last


def test_the_rendezvous_endpoint_form_starts_where_the_host_name_is_loopback(tmp_path):
    """`--rdzv-endpoint` (torchrun's c10d rendezvous): torch tells the endpoint's machine by
    its host name, which resolves to 127.0.0.1 here; tandem launch tells it by the route."""
    argv = [*TANDEM, "launch", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint",
            f"{ADDRS[0]}:{next(_ports)}", "--rdzv-id", "job7", "--", *JOB, "--out", "runs/job"]
    with TwoMachines(tmp_path) as net:
        results = run_both(net, [argv, argv], timeout=120)
        for node, (code, out, err) in enumerate(results):
            assert code == 0, err[-3000:]
            assert f"tandem launch: node {ADDRS[node]}: the workers talk through " in out, out
        assert "best val acc" in results[0][1]  # 192.0.2.1 sorts first: rank 0 on node 0
        assert os.listdir(net.dirs[1]) == []


def test_a_node_without_the_data_ends_every_node_at_once_saying_why(tmp_path):
    """Node 1 lacks the ImageFolder node 0 has: its worker refuses in one line and leaves it in
    the job's store, and node 0's worker, waiting for it at the roll call, ends with that line
    at once (not after --join-timeout)."""
    from conftest import make_image_folder

    job = ["train", "--strategy", "ddp", "--devices", "cpu", "--data", "flowers", "-b", "4",
           "--image-size", "16", "--epochs", "1", "--no-progress", "-j", "0"]
    with TwoMachines(tmp_path) as net:
        make_image_folder(tmp_path / "node0" / "flowers" / "train")
        make_image_folder(tmp_path / "node0" / "flowers" / "val")
        port = next(_ports)
        results = run_both(net, [launch_argv(n, port, job=job) for n in (0, 1)], timeout=120)
    (code0, _, err0), (code1, _, err1) = results
    said = told(err1)
    if said[-1].startswith("hint: "):  # the remedy, on a line of its own under the error
        said = said[:-1]
    assert code1 == 2 and said[-1].startswith("tandem: error: "), err1[-2000:]
    missing = said[-1][len("tandem: error: "):]
    assert code0 == 4 and told(err0) == [
        f"tandem: error: rank 0 (node 0, {ADDRS[0]}): the job cannot go on: rank 1 (node 1): "
        f"{missing}"], err0


@pytest.mark.parametrize("flags, said", [
    (["--lr", "0.02"], "--lr 0.02 where rank 0 (node 0, 192.0.2.1) has 0.05"),
    (["-b", "8"], "--batch-size 8 where rank 0 (node 0, 192.0.2.1) has 4"),
    (["-a", "cifar_resnet32"], "--arch cifar_resnet32 where rank 0 (node 0, 192.0.2.1) has "
                               "cifar_resnet20"),
], ids=["lr", "batch_size", "arch"])
def test_nodes_started_with_different_settings_refuse_in_one_line_before_any_step(
        tmp_path, flags, said):
    """A typo on one machine of many: node 1 types one flag otherwise. Both nodes end in the
    same one line naming the setting, its two values and the ranks, before any step (not a
    run that is neither, a hang until the timeout, or torch's traceback)."""
    with TwoMachines(tmp_path) as net:
        port = next(_ports)
        results = run_both(net, [launch_argv(0, port), launch_argv(1, port, job=[*JOB, *flags])],
                           timeout=180)
        for node, (code, out, err) in enumerate(results):
            assert code == 2, err[-3000:]
            assert told(err) == [f"tandem: error: rank 1 (node 1, 192.0.2.2) has {said}: every "
                                 "node must run the same command (only --node-rank differs)"], err
            assert "epoch 1/1" not in out and "Traceback" not in err
        assert not os.path.exists(os.path.join(net.dirs[0], "runs/job/checkpoint.pt"))


@pytest.mark.parametrize("save_every", [None, 4], ids=["no_save_every", "save_every_4"])
def test_a_lost_rank_0_ends_in_true_lines_and_a_bitwise_resume_or_a_refusal(straight, tmp_path,
                                                                           save_every):
    """Rank 0, which alone writes the run, is killed at step 9. Node 1's survivor says so and
    which checkpoint stands on node 0 (step 8's, as --save-every 4 made it; or that there is
    none and how to start again), node 0's launcher says the same; their commands resume
    bitwise, or a resume of the run with no checkpoint is refused in one line."""
    fault = cli_env(TANDEM_INJECT_FAULT="0:9:kill", **_WRITE_TIME if save_every else {})
    flags = ["--save-every", str(save_every)] if save_every else []
    with TwoMachines(tmp_path) as net:
        port = next(_ports)
        (code0, _, err0), (code1, _, err1) = run_both(
            net, [launch_argv(n, port, job=[*JOB, *flags]) for n in (0, 1)], fault)
        line1 = told(err1)[-1]
        assert code1 == 4 and len(told(err1)) == 1, err1[-3000:]
        assert line1.startswith("tandem: error: rank 1 (node 1, 192.0.2.2): lost rank 0 (node 0, "
                                "192.0.2.1) in step 9: "), line1
        [line0] = [x for x in told(err0) if x.startswith("tandem launch:")]
        assert code0 == 128 + 9 and line0.startswith("tandem launch: rank 0 (node 0, local rank "
                                                      "0, pid "), err0[-3000:]
        if save_every is None:
            assert line1.endswith("rank 0, which alone writes the run, is lost with it, and the "
                                  "run has no checkpoint yet: start it again (the same command, "
                                  "with --overwrite)"), line1
            assert line0.endswith("the run has no checkpoint yet: start it again (the same "
                                  "command, with --overwrite)"), line0
            again = next(_ports)
            resumed = run_both(net, [launch_argv(n, again, job=[
                "train", "--resume", "runs/job", "--no-progress"]) for n in (0, 1)])
            assert resumed[0][0] == 2 and "no checkpoint" in told(resumed[0][2])[-1], resumed
            return
        # the checkpoint of step 8 was being written off the step's path when rank 0 died a
        # step later: the survivor, which heard of it only as made, says both; node 0's
        # launcher, told by rank 0's writer, says the one on its disk
        assert ("rank 0, which alone writes the run, is lost with it: the last checkpoint stands "
                "(runs/job/checkpoint.pt from step 8 on node 0") in line1, line1
        saved = os.path.join(net.dirs[0], "runs/job/checkpoint.pt")
        if not os.path.exists(saved):  # no write had ended: the lines say so (see _WRITE_TIME)
            assert "if rank 0 finished writing it (else" in line1, line1
            assert line0.endswith("the run has no checkpoint yet: start it again (the same "
                                  "command, with --overwrite)"), line0
            return
        on_disk = torch.load(saved, weights_only=True)["data_position"]["step"]
        assert on_disk in (4, 8)
        assert (f"the last checkpoint is runs/job/checkpoint.pt from step {on_disk} on node 0"
                in line0), line0
        commands = {**continue_commands(line0), **continue_commands(line1)}
        assert sorted(commands) == [0, 1], (line0, line1)
        for code, out, err in run_both(net, [commands[0], commands[1]]):
            assert code == 0, err[-3000:]
        assert_bitwise_equal(os.path.join(net.dirs[0], "runs/job/checkpoint.pt"),
                             os.path.join(straight[0][0], "runs/job/checkpoint.pt"))


@pytest.mark.parametrize("save_every", [None, 4], ids=["no_save_every", "save_every_4"])
def test_max_restarts_after_losing_rank_0_continues_from_its_last_checkpoint(straight, tmp_path,
                                                                           save_every):
    """torchrun restarts the job after rank 0 was killed: from the last checkpoint on rank 0's
    disk (--save-every 4), or, with none saved, from step 1 and saying so; bitwise equal to the
    straight run either way."""
    fault = cli_env(TANDEM_INJECT_FAULT="0:9:kill", **_WRITE_TIME if save_every else {})
    flags = ["--save-every", str(save_every)] if save_every else []
    with TwoMachines(tmp_path) as net:
        port = next(_ports)
        results = run_both(net, [launch_argv(n, port, "--max-restarts", "1",
                                             job=[*JOB, *flags]) for n in (0, 1)], fault)
        for code, out, err in results:
            assert code == 0, err[-3000:]
        out0 = results[0][1]
        if save_every is None:
            assert ("torchrun restart 1: the run had saved no checkpoint before the failure, so "
                    "it starts again from step 1") in out0, out0
        else:  # step 8's checkpoint, or step 4's where rank 0 died while writing step 8's, or
            # (no write ended, see _WRITE_TIME) none
            assert re.search(r"resuming runs/job/checkpoint.pt at epoch 1/1, step ([48]) \(\1/16 "
                             r"batches of the epoch done\) \(torchrun restart 1\)", out0) or (
                "torchrun restart 1: the run had saved no checkpoint before the failure, so it "
                "starts again from step 1") in out0, out0
        assert_bitwise_equal(os.path.join(net.dirs[0], "runs/job/checkpoint.pt"),
                             os.path.join(straight[0][0], "runs/job/checkpoint.pt"))
