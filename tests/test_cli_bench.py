"""tandem bench's torchrun phase against tandem.distributed.launch (spied on, never run
here). Nothing is timed."""

from __future__ import annotations

import json
import subprocess

import pytest

from tandem.bench import BenchConfig
from tandem.bench.distributed import distributed_phase, worker_main
from tandem.distributed import launch
from tandem.errors import UsageError


# -- the torchrun phase goes through tandem.distributed.launch ------------------------------

def _config(**kw) -> BenchConfig:
    return BenchConfig(arch="cifar_resnet20", strategies="single,ddp", devices="cpu:2",
                       baselines="none", dist_timeout=7, **kw)


def _spy_launcher(monkeypatch, returncode=0, stderr="", write=True, expire=False) -> list:
    """Replace launch.run_captured; it records its calls and acts as torchrun would have."""
    calls = []

    def run_captured(spec, timeout=None):
        calls.append((spec, timeout))
        if expire:
            raise subprocess.TimeoutExpired(launch.torchrun_argv(spec), timeout)
        command = spec.command
        if write:
            names = command[command.index("--names") + 1].split(",")
            with open(command[command.index("--out") + 1], "w") as f:
                json.dump([{"name": n, "status": "ok"} for n in names], f)
        return subprocess.CompletedProcess(launch.torchrun_argv(spec), returncode, "", stderr)

    monkeypatch.setattr(launch, "run_captured", run_captured)
    return calls


def test_the_torchrun_phase_runs_through_launch_run_captured(monkeypatch):
    calls = _spy_launcher(monkeypatch)
    assert distributed_phase(_config(threads=1), ["ddp"]) == [{"name": "ddp", "status": "ok"}]
    [(spec, timeout)] = calls
    assert timeout == 7 and spec.nproc_per_node == 2 and spec.max_restarts == 0
    assert spec.extra_env == {"OMP_NUM_THREADS": "1"}
    argv = launch.torchrun_argv(spec)
    assert argv[argv.index("-m") + 1:argv.index("-m") + 3] == ["tandem.bench.distributed",
                                                               "--config"]
    assert argv[argv.index("--rdzv-endpoint") + 1] == "127.0.0.1:0"


def test_without_threads_the_workers_split_torchs_or_keep_omp(monkeypatch):
    calls = _spy_launcher(monkeypatch)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    distributed_phase(_config(), ["ddp"])
    assert calls[-1][0].extra_env == {}  # the caller's OMP_NUM_THREADS reaches the workers
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr("torch.get_num_threads", lambda: 8)
    distributed_phase(_config(), ["ddp"])
    assert calls[-1][0].extra_env == {"OMP_NUM_THREADS": "4"}


@pytest.mark.parametrize("spy, reason", [
    (dict(returncode=1, stderr="noise\nRuntimeError: boom\nmore noise\n"),
     "torchrun phase exited with 1: RuntimeError: boom"),
    (dict(expire=True), "torchrun phase timed out after 7s"),
    (dict(write=False), "torchrun phase wrote no results"),
])
def test_a_failed_torchrun_phase_fails_each_contestant_with_one_reason(monkeypatch, spy,
                                                                       reason):
    _spy_launcher(monkeypatch, **spy)
    [result] = distributed_phase(_config(), ["ddp"])
    assert (result["status"], result["reason"], result["phase"]) == ("failed", reason,
                                                                     "torchrun")


def test_a_worker_started_by_hand_says_how_to_launch(monkeypatch, tmp_path):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(_config().to_dict()))
    with pytest.raises(UsageError, match="tandem.bench.distributed needs torchrun's environment"):
        worker_main(["--config", str(config), "--names", "ddp", "--out", str(tmp_path / "o")])
