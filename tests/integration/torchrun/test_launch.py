"""``tandem launch`` end to end: 2 gloo workers on 127.0.0.1, each run with a hard timeout.

- a 2-process ``--strategy ddp --sync-bn`` run, and a 2-machine run (two launchers with
  ``--nnodes 2 --node-rank 0/1`` in two network namespaces), both reach the weights and metrics of
  ``--strategy single`` after 3 steps of 2 accumulated batches, through a short last batch of
  1 sample (rank 1's share is empty);
- a worker that raises, hangs, or is SIGKILLed stops the whole job with a non-zero status in
  bounded time, the failed rank named, and no worker process left behind; a loopback master
  for several nodes is refused;
- a SIGKILL of rank 0 (the writer) mid-run leaves a loadable ``checkpoint.pt``, from which
  every rank of a new job resumes;
- the README's launch on digits prints no warning (none of DDP's "Grad strides"), and a failed
  worker's job shows tandem's lines, not torchrun's error line or its warnings;
- a busy ``--master-port``, ``--strategy ddp`` outside torchrun, and launch mistakes give one
  line, no traceback.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from conftest import (DIST_VARS, cli_env, processes_with, run_bounded, run_in_process,
                      torchrun_workers)
from ddp_runs import launch_runs, outputs
from exact import check_invariance

from two_machines import ADDRS, TwoMachines, unavailable

from tandem import checkpoint
from tandem.cli.main import main

TANDEM = [sys.executable, "-m", "tandem"]
# 11 samples in global batches of 5: 5, 5, 1 -> shares 3+2, 3+2, 1+0 over 2 ranks. Two
# batches per optimizer step (the first under no_sync), so an epoch is 2 steps, the second a
# short one of 1 batch; --max-steps 3 stops in epoch 2.
# 16 px, not 8: at 8 px the last stage's 2x2 maps make batch norm ill-conditioned enough to
# amplify float32 rounding to ~1e-4 in 3 steps (the update is still the same one).
TRAIN = ["train", "--data", "synthetic", "--synthetic-size", "11", "--image-size", "16",
         "--augment", "standard", "--num-classes", "3", "--batch-size", "5",
         "--accum-steps", "2", "--epochs", "2", "--max-steps", "3",
         "--no-progress", "--seed", "3", "--devices", "cpu"]

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


_env = cli_env  # one intra-op thread, TANDEM_DIST_TIMEOUT=60, no torchrun variables


def _run(args, timeout=150, **env):
    start = time.monotonic()
    proc = run_bounded(TANDEM + args, timeout, _env(**env))
    return proc, time.monotonic() - start


def _assert_no_workers_left(marker: str) -> None:
    deadline = time.monotonic() + 10  # the agent has already reaped them; allow slack
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_with(marker) == [], f"orphan workers: {processes_with(marker)}"


def _weights(path) -> dict:
    return checkpoint.load(str(path))["state_dict"]


F64 = ["--dtype", "float64"]  # well-posed comparisons: see tests/support/exact.py


def _assert_matches_single(single_run, candidate) -> None:
    check_invariance(single_run / "checkpoint.pt", {"candidate": candidate},
                     reference32=single_run / "f32" / "checkpoint.pt",
                     negative64=single_run / "negative" / "checkpoint.pt")


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    """single in float64, and in it the controls: float32 (f32/) and dp without --sync-bn
    (negative/)."""
    out = tmp_path_factory.mktemp("single")
    # In this process (run_in_process: one intra-op thread, as the launched workers have):
    # none of these needs torchrun or a fresh interpreter, and each start-up costs seconds.
    for args in (["--strategy", "single", *F64, "--out", str(out)],
                 ["--strategy", "single", "--out", str(out / "f32")],
                 ["--strategy", "dp", "--devices", "cpu:2", *F64, "--out", str(out / "negative")]):
        proc = run_in_process(*TRAIN, *args)
        assert proc.returncode == 0, proc.stderr
    return out


# -- equality with the single-process run ------------------------------------------------------
def test_launch_ddp_sync_bn_matches_single(single_run, tmp_path):
    out = tmp_path / "ddp"
    proc, _ = _run(["launch", "--nproc-per-node", "2", "--", *TRAIN, *F64, "--strategy", "ddp",
                    "--sync-bn", "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    _assert_matches_single(single_run, out / "checkpoint.pt")
    # Only rank 0 printed the epoch summary and wrote the outputs.
    assert proc.stdout.count("epoch 1/2 step 2") == 1, proc.stdout
    assert proc.stdout.count("epoch 2/2 (partial: 2/3 batches) step 3") == 1, proc.stdout
    ddp_log = [json.loads(line) for line in open(out / "metrics.jsonl")]
    single_log = [json.loads(line) for line in open(single_run / "metrics.jsonl")]
    assert len(ddp_log) == len(single_log) == 2
    assert len(list((out / "tb").iterdir())) == 1  # TensorBoard: rank 0's events file only
    for ddp_epoch, single_epoch in zip(ddp_log, single_log):
        for key in ("train_loss", "val_loss", "val_acc", "train_acc"):
            assert abs(ddp_epoch[key] - single_epoch[key]) < 1e-4, key


def test_readme_launch_on_digits_prints_no_warning(tmp_path):
    """Issue 25 item 13: the README's headline launch (``ddp --sync-bn`` on digits, whose
    1-channel conv1 once got its gradient in other strides than DDP's bucket, and every rank
    printed "Grad strides do not match bucket view strides"), shortened, with Python's
    warnings shown: no warning. ``tests/integration/torchrun/test_ddp_step.py`` checks the
    gradients' bits."""
    out = tmp_path / "digits"
    proc, _ = _run(["launch", "--nproc-per-node", "2", "--", "train", "--strategy", "ddp",
                    "--sync-bn", "--data", "digits", "--max-steps", "2", "-b", "10",
                    "--no-progress", "--out", str(out)], PYTHONWARNINGS="default")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Warning" not in proc.stderr, proc.stderr[-4000:]
    assert "epoch 1/" in proc.stdout and (out / "checkpoint.pt").exists()


@pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
def test_two_machines_match_single(single_run, tmp_path):
    """Two nodes in two network namespaces (tests/support/two_machines.py), each its own
    directory."""
    job = [*TRAIN, *F64, "--strategy", "ddp", "--sync-bn", "--out", "two_nodes"]
    with TwoMachines(tmp_path) as net:
        nodes = [net.start(rank, TANDEM + [
            "launch", "--nnodes", "2", "--node-rank", str(rank), "--master-addr", ADDRS[0],
            "--master-port", "29599", "--nproc-per-node", "1", "--", *job], _env())
            for rank in (0, 1)]
        outputs = [node.communicate(timeout=150) for node in nodes]
        for node, (out, err) in zip(nodes, outputs):
            assert node.returncode == 0, err[-3000:]
        assert "epoch 2/2 (partial: 2/3 batches) step 3" in outputs[0][0]
        assert "epoch 2/2" not in outputs[1][0]
        _assert_matches_single(single_run, tmp_path / "node0" / "two_nodes" / "checkpoint.pt")


def test_two_nodes_on_loopback_are_refused_before_any_rendezvous(tmp_path):
    """Every node would reach only itself: one line naming the fix, nothing started."""
    proc = run_in_process("launch", "--nnodes", "2", "--node-rank", "1", "--master-addr",
                          "127.0.0.1", "--master-port", "29598", "--nproc-per-node", "1", "--",
                          *TRAIN, "--strategy", "ddp", "--out", tmp_path / "x")
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    assert proc.stderr == ("tandem: error: --master-addr 127.0.0.1 is a loopback address "
                           "(127.0.0.1): the other nodes cannot reach it; give node 0's address "
                           "on the network the nodes share (e.g. --master-addr 192.0.2.1)\n")
    assert not (tmp_path / "x").exists()


def _progress_against_epoch_lines(stdout: str) -> list[tuple[str, str]]:
    """(the -p line's loss and acc at an epoch's last batch, the epoch line's) per epoch."""
    shown = re.findall(r"^epoch (\d+)/\d+ \[3/3\] loss (\S+) acc (\S+)", stdout, re.M)
    epochs = re.findall(r"^epoch (\d+)/\d+ step \d+: train loss (\S+) acc (\S+)", stdout, re.M)
    assert shown and len(shown) == len(epochs), stdout
    return list(zip(shown, epochs))


def test_ddp_progress_lines_show_every_ranks_sums_also_after_a_resume(tmp_path):
    """11 samples in batches of 5 over 2 ranks (shares 3+2, 3+2, 1+0): at an epoch's last batch
    the -p line is the epoch's whole train loss and acc, not rank 0's part of it. The run and
    its resume are two commands of one 2-process launch (tests/support/ddp_runs.py)."""
    out = tmp_path / "run"
    ddp = ["train", "--data", "synthetic", "--synthetic-size", "11", "--image-size", "8",
           "--num-classes", "3", "--batch-size", "5", "--seed", "3", "--no-progress",
           "--devices", "cpu", "--strategy", "ddp", "-p", "3"]
    # epoch 1, then a stop after batch 1 of epoch 2; the resume carries its sums to the line
    result = launch_runs([([*ddp, "--epochs", "2", "--max-steps", "4", "--out", out], False),
                          ([*ddp, "--resume", out, "--epochs", "2"], False)], timeout=240)
    assert result.returncode == 0, result.stderr[-4000:]
    for epoch, stdout in zip(("1", "2"), outputs(result.stdout)):
        [(shown, summary)] = _progress_against_epoch_lines(stdout)
        assert shown == summary and shown[0] == epoch


# -- faults ------------------------------------------------------------------------------------
def test_worker_error_stops_the_job(tmp_path):
    out = tmp_path / "raise"
    proc, _ = _run(["launch", "--nproc-per-node", "2", "--", *TRAIN, "--strategy", "ddp",
                    "--out", str(out)], TANDEM_INJECT_FAULT="1:2:raise")
    assert proc.returncode != 0, proc.stderr[-4000:]
    # a bug keeps its traceback; its peer says in one line that rank 1 is gone
    assert "RuntimeError: injected fault on rank 1 at step 2" in proc.stderr
    assert re.search(r"^tandem: error: rank 0 \(node 0, \S+\): lost rank 1 \(node 0, \S+\) in "
                     r"step 1: ", proc.stderr, re.M), proc.stderr[-4000:]
    # tandem launch names the failed rank when the worker did not (rank 1's traceback), in
    # place of torchrun's error line; torchrun's warnings about stopping the other do not show
    if "exited with code 1" in proc.stderr:
        assert "tandem launch: rank 1 " in proc.stderr and "the job was stopped" in proc.stderr
    assert not re.search(r"^E\d{4} .* failed \(exitcode: ", proc.stderr, re.M)
    assert not re.search(r"^W\d{4} |closing signal", proc.stderr, re.M), proc.stderr[-4000:]
    _assert_no_workers_left(str(out))


def test_hung_worker_times_out(tmp_path):
    out = tmp_path / "hang"
    proc, _ = _run(["launch", "--nproc-per-node", "2", "--dist-timeout", "5", "--",
                    *TRAIN, "--strategy", "ddp", "--out", str(out)], TANDEM_INJECT_FAULT="1:2:hang")
    # Rank 0 gives up in its collective after --dist-timeout's 5 s (not the environment's 60 s),
    # saves the last completed step and says so in one line (exit status 4); the agent then
    # stops the hung rank 1, and tandem launch adds nothing to rank 0's line.
    assert proc.returncode == 4, proc.stderr[-4000:]
    lines = [x for x in proc.stderr.splitlines() if not x.startswith("tandem: injected")]
    assert len(lines) == 1, proc.stderr[-4000:]
    assert re.match(r"tandem: error: rank 0 \(node 0, \S+\): lost rank 1 \(node 0, \S+\) in step "
                    r"1: no answer for 5 s \(--dist-timeout\); saved \S+checkpoint.pt at epoch 1, "
                    r"step 0; continue with: tandem launch --nproc-per-node 2 --dist-timeout 5.0 "
                    r"-- train --resume ", lines[0]), lines[0]
    _assert_no_workers_left(str(out))


def test_a_lost_peer_under_hybrid_keeps_the_last_checkpoint_and_says_so(tmp_path):
    """hybrid-ddp's head is split over the ranks: the survivor cannot gather the model once a
    peer is gone, so it saves nothing then and says which checkpoint stands (the one saved at
    step 2, untouched), instead of hanging in a gather or writing a wrong one."""
    out = tmp_path / "hybrid"
    job = ["train", "--data", "synthetic", "--synthetic-size", "40", "--image-size", "16",
           "--num-classes", "3", "--batch-size", "4", "--epochs", "1", "--save-every", "2",
           "--no-progress", "--seed", "3", "--devices", "cpu", "--strategy", "hybrid",
           "--out", str(out)]
    proc, _ = _run(["launch", "--nproc-per-node", "2", "--", *job],
                   TANDEM_INJECT_FAULT="1:4:kill")
    # rank 0's exit status 4 or the launcher's word on the killed rank 1, whichever torchrun
    # sees first (as for ddp); rank 0's line is the same either way
    assert proc.returncode != 0, proc.stderr[-4000:]
    assert re.search(r"^tandem: error: rank 0 \(node 0, \S+\): lost rank 1 \(node 0, \S+\) in "
                     r"step 4: .*; its model is split across the processes and cannot be saved "
                     r"without the lost one: the last checkpoint stands \(\S+checkpoint.pt from "
                     r"step 2 on node 0\); continue with: tandem launch --nproc-per-node 2 -- train "
                     r"--resume ", proc.stderr, re.M), proc.stderr[-4000:]
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    assert ckpt["data_position"]["step"] == 2
    _assert_no_workers_left(str(out))


def test_sigkill_of_rank0_keeps_last_checkpoint_and_every_rank_resumes(tmp_path):
    out = tmp_path / "killed"
    long_run = ["train", "--data", "synthetic", "--synthetic-size", "20", "--image-size", "8",
                "--num-classes", "3", "--batch-size", "5", "--epochs", "500", "--no-progress",
                "--devices", "cpu", "--strategy", "ddp", "--out", str(out)]
    launcher = subprocess.Popen(TANDEM + ["launch", "--nproc-per-node", "2", "--", *long_run],
                                env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    try:
        deadline = time.monotonic() + 120
        metrics = out / "metrics.jsonl"
        while time.monotonic() < deadline and launcher.poll() is None:
            if metrics.exists() and metrics.read_text().strip():
                break
            time.sleep(0.1)
        pid = torchrun_workers(str(out)).get(0)
        assert pid is not None, "rank 0 worker not found"
        os.kill(pid, signal.SIGKILL)
        _, stderr = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert launcher.returncode == 128 + signal.SIGKILL, stderr[-4000:]
    assert "tandem launch: rank 0 (node 0, local rank 0" in stderr and "SIGKILL" in stderr
    assert "the last checkpoint is " in stderr and "continue with: tandem launch" in stderr
    _assert_no_workers_left(str(out))
    ckpt = checkpoint.load(str(out / "checkpoint.pt"))  # loadable, not torn
    assert ckpt["epoch"] >= 1
    # Both ranks of a new job load that file and train on from it.
    resumed = tmp_path / "resumed"
    step = ckpt["epoch"] * 4
    proc, _ = _run(["launch", "--nproc-per-node", "2", "--", *long_run[:-1], str(resumed),
                    "--resume", str(out / "checkpoint.pt"), "--max-steps", str(step + 2)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert checkpoint.load(str(resumed / "checkpoint.pt"))["epoch"] == ckpt["epoch"]


@pytest.mark.slow
def test_run_captured_runs_a_module_on_every_worker_and_returns_its_output(tmp_path):
    """The bench's way in (tandem.distributed.torchrun.run_captured): torchrun in a child, its
    workers' output captured, ``extra_env`` added to what this process has."""
    from tandem.distributed.torchrun import LaunchSpec, run_captured

    # One write per worker: the two share torchrun's pipe, and print()'s pieces, unbuffered,
    # interleaved there ("rank 0rank 2  yes1 ...") once in a few runs.
    (tmp_path / "probe_worker.py").write_text(
        "import os, sys\nline = ' '.join(['rank', os.environ['RANK'], os.environ['WORLD_SIZE'], "
        "os.environ['PROBE'], str(sys.argv[1:])])\nos.write(1, (line + '\\n').encode())\n")
    spec = LaunchSpec(nproc_per_node=2, command=["--flag"], module="probe_worker",
                      rdzv_endpoint="127.0.0.1:0",
                      extra_env={"PYTHONPATH": str(tmp_path), "PROBE": "yes"})
    proc = run_captured(spec, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank "))
    assert lines == ["rank 0 2 yes ['--flag']", "rank 1 2 yes ['--flag']"], \
        (proc.stdout[-2000:], proc.stderr[-4000:])  # what torchrun said, if a line is missing


# -- one-line errors ---------------------------------------------------------------------------
def test_port_in_use_is_one_clear_line(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # in this process: the launcher refuses before it starts torchrun or any worker
        proc = run_in_process("launch", "--nproc-per-node", "2", "--master-port", port, "--",
                              *TRAIN, "--strategy", "ddp", "--out", tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"tandem: error: port {port} on 127.0.0.1 is already in "
                                   "use; pick another with --master-port")


def test_ddp_without_torchrun_is_one_line(tmp_path, capsys, monkeypatch):
    for var in DIST_VARS:
        monkeypatch.delenv(var, raising=False)
    assert main([*TRAIN, "--strategy", "ddp", "--out", str(tmp_path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2, lines  # the error, and how to launch it on a line of its own
    assert lines[0].startswith("tandem: error: --strategy ddp needs torchrun's environment")
    assert lines[1].startswith("hint: run it with `tandem launch --nproc-per-node N -- train")


def _torchruns_timing_wrapper(sigval):
    """What torchrun's metrics wrapper does when the signal lands before its start time is
    set: the SignalException, then an UnboundLocalError from its own ``finally``."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def run(args):
        try:
            if sigval is not None:
                raise SignalException("got signal", sigval=sigval)
            raise ValueError("not a signal")
            start = 0  # noqa: F841 (never reached, as in torchrun)
        finally:
            start  # noqa: B018 (unbound: UnboundLocalError)
    return run


@pytest.mark.parametrize("sigval", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_that_breaks_torchruns_own_bookkeeping_is_still_one_line(monkeypatch, capsys,
                                                                         sigval):
    """Ctrl-C while torchrun's agent was between two lines of its timing wrapper (seen once in
    the suite): the same line and exit status as any other stop, not torchrun's traceback.
    Negative control: the same failure with no signal behind it is raised as it is."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from tandem.distributed.torchrun import LaunchSpec, launch

    spec = LaunchSpec(nproc_per_node=1, command=["train", "--strategy", "ddp"])
    monkeypatch.setenv("TANDEM_LAUNCH_ID", "x")  # launch() sets it when unset
    monkeypatch.setattr(torchrun, "run", _torchruns_timing_wrapper(sigval))
    assert launch(spec) == 128 + int(sigval)
    assert capsys.readouterr().err.strip() == \
        f"tandem launch: stopped by {sigval.name}; the workers were stopped"
    monkeypatch.setattr(torchrun, "run", _torchruns_timing_wrapper(None))
    with pytest.raises(UnboundLocalError):
        launch(spec)

    def signalled(args):  # the usual case: the signal itself, which the agent passed on
        raise SignalException("got signal", sigval=sigval)
    monkeypatch.setattr(torchrun, "run", signalled)
    assert launch(spec) == 128 + int(sigval)
    assert capsys.readouterr().err.strip() == \
        f"tandem launch: stopped by {sigval.name}; the workers were passed it on"


DDP = ["train", "--strategy=ddp"]


@pytest.mark.parametrize("argv, message", [
    (["--nproc-per-node", "2"], "no command to launch"),
    (["--nproc-per-node", "2", "--", "launch"], "must be a tandem subcommand"),
    (["--nproc-per-node", "2", "--", "train"], "needs --strategy hybrid, ddp, hybrid-ddp or auto"),
    (["--nproc-per-node", "2", "--", "train", "--strategy", "dp"], "needs --strategy hybrid, ddp, hybrid-ddp or auto"),
    (["--nproc-per-node", "0", "--", *DDP], "bad --nproc-per-node 0"),
    (["--nproc-per-node", "1", "--nnodes", "2", "--", *DDP], "needs --master-addr"),
    (["--nproc-per-node", "1", "--nnodes", "2", "--node-rank", "2", "--master-addr", "h",
      "--master-port", "9", "--", *DDP], "bad --node-rank 2"),
    (["--nproc-per-node", "1", "--nnodes", "1:2", "--", *DDP], "needs --rdzv-endpoint"),
    (["--nproc-per-node", "1", "--rdzv-endpoint", "h:1", "--master-port", "5", "--", *DDP],
     "not both"),
    (["--nproc-per-node", "1", "--dist-timeout", "0", "--", *DDP], "bad --dist-timeout"),
])
def test_launch_mistakes_are_one_line(capsys, argv, message):
    assert main(["launch", *argv]) == 2
    err = capsys.readouterr().err.strip()
    error, *hint = err.splitlines()  # one line, and maybe its remedy on a line of its own
    assert error.startswith("tandem: error: ") and message in error, err
    assert hint == [] or (len(hint) == 1 and hint[0].startswith("hint: ")), err


def test_launch_reads_the_strategy_as_the_workers_parse_it(tmp_path, monkeypatch, capsys):
    """The launcher takes the strategy from the workers' own parser and config: ``--strat ddp``
    (argparse's abbreviation), ``--strategy=ddp`` and a later flag winning are ``--strategy
    ddp``; ``--strat dp`` is refused; a resumed run without the flag keeps its own. torchrun is
    replaced by a spy: only the launcher's decision is checked here."""
    import tandem.cli.launch as cli_launch
    from tandem.cli.main import build_parser
    from tandem.cli.train import config_from_namespace
    from tandem.config import ParallelConfig, TrainConfig

    launched = []
    monkeypatch.setattr(cli_launch, "launch", lambda spec: launched.append(spec.command) or 0)
    out = ["--out", str(tmp_path / "run")]
    for flags in (["--strat", "ddp"], ["--strategy=ddp"], ["--strategy", "dp", "--strat", "ddp"]):
        command = [*TRAIN, *flags, *out]
        assert main(["launch", "--nproc-per-node", "2", "--", *command]) == 0, \
            capsys.readouterr().err
        assert launched.pop() == command  # handed to the workers as typed
        # ... where it is what the workers' train parses, as --strategy ddp is
        assert config_from_namespace(build_parser().parse_args(command)).parallel.strategy \
            == "ddp"
    assert main(["launch", "--nproc-per-node", "2", "--", *TRAIN, "--strat", "dp", *out]) == 2
    assert "needs --strategy hybrid, ddp, hybrid-ddp or auto" in capsys.readouterr().err

    run = tmp_path / "resumed"
    run.mkdir()
    for strategy, code in (("ddp", 0), ("single", 2)):
        saved = TrainConfig(parallel=ParallelConfig(strategy=strategy)).to_dict()
        (run / "config.json").write_text(json.dumps(saved))
        assert main(["launch", "--nproc-per-node", "2", "--", "train", "--resume",
                     str(run)]) == code, strategy
    assert "needs --strategy hybrid, ddp, hybrid-ddp or auto" in capsys.readouterr().err
    assert launched == [["train", "--resume", str(run)]]


# -- CUDA (NCCL) -------------------------------------------------------------------------------
@pytest.mark.cuda
def test_ddp_on_cuda_with_nccl_matches_single(tmp_path):
    """One process per GPU (up to 2), NCCL; cuDNN/TF32 rounding allows a looser tolerance."""
    nproc = min(2, torch.cuda.device_count())
    cuda_train = [a if a != "cpu" else "cuda" for a in TRAIN]
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    proc, _ = _run([*cuda_train, "--strategy", "single", "--out", str(single)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    proc, _ = _run(["launch", "--nproc-per-node", str(nproc), "--", *cuda_train, "--strategy",
                    "ddp", "--sync-bn", "--out", str(ddp)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    config = json.load(open(ddp / "config.json"))
    assert config["resolved"]["devices"] == ["cuda:0"]  # rank 0's own device only
    assert config["resolved"]["world_size"] == nproc
    a, b = _weights(ddp / "checkpoint.pt"), _weights(single / "checkpoint.pt")
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=5e-3, rtol=1e-2, msg=k)


def test_plain_torchrun_with_a_one_process_strategy_is_refused_in_one_line(tmp_path):
    """`torchrun -m tandem train --strategy dp` (not through `tandem launch`, which refuses it
    itself): every worker refuses before the workers meet, rank 0 says it in one line, and
    nothing is trained or written (two copies would otherwise write one run directory)."""
    out = tmp_path / "dp"
    proc = run_bounded([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "2", "-m", "tandem", *TRAIN, "--strategy", "dp",
                        "--devices", "cpu:2", "--out", str(out)], 150, _env())
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if line.startswith(("tandem: ", "hint: "))]
    assert ours == ["tandem: error: several processes (torchrun) needs --strategy hybrid, ddp, "
                    "hybrid-ddp or auto, not dp",
                    "hint: each process trains its share of every batch; a one-process "
                    "strategy would train N independent copies writing the same files"
                    ], proc.stderr[-3000:]
    assert not out.exists()  # (torchrun's agent itself prints its ChildFailedError whole)
