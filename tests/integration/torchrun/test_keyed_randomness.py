"""Keyed dropout and drop path against `single`: with the randomness on, dp and balanced over 3 CPU
replicas, hybrid in one process, ddp and hybrid-ddp over 2 gloo processes, and runs resumed on
another process count, all reach single's weights in float64.

Two configs, each trained 3 steps (16 samples in global batches of 7: 3+2+2 over 3 replicas
twice, then a last batch of 2, fewer than the replicas; 4+3 and 1+1 over 2 ranks):
``dropout_net:alexnet_like`` (AlexNet's classifier with its dropout 0.5, a channel dropout
before it; hybrid splits the classifier, so its second dropout acts on column blocks), and
``cifar_resnet20 --drop-path 0.1 --sync-bn``. Each comparison has the controls of
tests/support/exact.py (float32 noise floor; negative control: the same strategy under
``--dropout-rng torch``, whose draws depend on the partition, at least 1e-4 from single's own
torch run), and the randomness is shown to change the run (p 0.5 against 0: more than 1e-4).
"""

from __future__ import annotations

import pytest
import torch
from pathlib import Path

from conftest import built_once, ok
from ddp_runs import launch_runs
from exact import check_invariance, max_diff, state

pytestmark = pytest.mark.slow

BASE = ["train", "--data", "synthetic", "--synthetic-size", "16", "--image-size", "8",
        "--num-classes", "5", "-b", "7", "--no-progress", "--seed", "3", "--devices", "cpu"]
F64 = ["--dtype", "float64"]
TORCH = ["--dropout-rng", "torch"]
CONFIGS = {
    "dropout": ["-a", "dropout_net:alexnet_like", "--epochs", "1"],
    "drop_path": ["-a", "cifar_resnet20", "--drop-path", "0.1", "--sync-bn", "--epochs", "1"],
}
OFF = {"dropout": ["--dropout", "0"], "drop_path": ["--drop-path", "0"]}  # no randomness
ONE_PROCESS = {"dp": ["--strategy", "dp", "--devices", "cpu:3"],
               "balanced": ["--strategy", "balanced", "--devices", "cpu:3"],
               "hybrid": ["--strategy", "hybrid", "--devices", "cpu:3"]}
PROCESSES = {"ddp": ["--strategy", "ddp"], "hybrid-ddp": ["--strategy", "hybrid"]}
# the resume runs: the dropout config over 2 epochs (6 steps), stopped and resumed mid-epoch
RESUMED = [*BASE, "-a", "dropout_net:alexnet_like", "--epochs", "2", *F64]
APART = 1e-4  # what "the randomness changes the run" and "torch's draws differ" mean here


def _checkpoint(out):
    return out / "checkpoint.pt"


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """Per config, single: keyed in float64 (the reference) and float32 (the noise floor),
    with the randomness off, and under --dropout-rng torch; and the resume runs' references
    (straight, float32, and off). Once for all workers."""
    return Path(built_once(tmp_path_factory, "keyed_single", _single))


def _single(root):
    for name, config in CONFIGS.items():
        for run, extra in (("f64", F64), ("f32", []), ("off", [*F64, *OFF[name]]),
                           ("torch", [*F64, *TORCH])):
            ok(*BASE, *config, *extra, "--out", root / name / run)
    ok(*RESUMED, "--out", root / "straight")
    ok(*RESUMED[:-2], "--out", root / "straight32")
    ok(*RESUMED, "--dropout", "0", "--out", root / "straight_off")
    return str(root)


@pytest.fixture(scope="module")
def launched(single, tmp_path_factory):
    """The multi-process runs: in one 2-process launch, ddp and hybrid-ddp on each config
    (keyed, and under --dropout-rng torch), a 2-process ddp run stopped after 2 steps, and a
    1-process (single) run of 4 steps resumed there; then that 2-process run resumed in a
    3-process launch. Once for all workers."""
    return Path(built_once(tmp_path_factory, "keyed_launched", _launched))


def _launched(root):
    ok(*RESUMED, "--max-steps", "4", "--out", root / "one")  # 1 process, 4 of the 6 steps
    runs = []
    for name, config in CONFIGS.items():
        for strategy, flags in PROCESSES.items():
            for rng, extra in (("keyed", []), ("torch", TORCH)):
                runs.append(([*BASE, *config, *F64, *flags, *extra, "--out",
                              root / name / strategy / rng], False))
    runs.append(([*RESUMED, "--strategy", "ddp", "--max-steps", "2", "--out", root / "two"],
                 False))
    runs.append((["train", "--resume", root / "one", "--strategy", "ddp", "--no-progress"],
                 False))
    result = launch_runs(runs, timeout=600, PYTHONWARNINGS="ignore")
    assert result.returncode == 0, result.stderr[-3000:]
    result = launch_runs([(["train", "--resume", root / "two", "--strategy", "ddp",
                            "--no-progress"], False)], nproc=3, timeout=300,
                         PYTHONWARNINGS="ignore")
    assert result.returncode == 0, result.stderr[-3000:]
    return str(root)


def _matches_single(single, name, keyed, torch_run):
    """``keyed`` equals single's keyed run (with exact.py's controls, the negative being
    ``torch_run``), whose randomness changes the run; ``torch_run`` is apart from single's
    own torch run."""
    ref = single / name
    figures = check_invariance(_checkpoint(ref / "f64"), {"keyed": keyed},
                               reference32=_checkpoint(ref / "f32"), negative64=torch_run)
    off = max_diff(state(_checkpoint(ref / "off")), state(_checkpoint(ref / "f64")))
    assert off > APART, f"{name}: the randomness changes the run by only {off:.3g}"
    apart = max_diff(state(torch_run), state(_checkpoint(ref / "torch")))
    assert apart > APART, f"{name}: torch's draws agree with single's ({apart:.3g})"
    return figures


@pytest.mark.parametrize("strategy", list(ONE_PROCESS))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_one_process_strategies_equal_single(single, name, strategy, tmp_path):
    for rng, extra in (("keyed", []), ("torch", TORCH)):
        ok(*BASE, *CONFIGS[name], *F64, *ONE_PROCESS[strategy], *extra, "--out",
           tmp_path / rng)
    _matches_single(single, name, _checkpoint(tmp_path / "keyed"),
                    _checkpoint(tmp_path / "torch"))


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", list(PROCESSES))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_two_processes_equal_single(single, launched, name, strategy):
    run = launched / name / strategy
    _matches_single(single, name, _checkpoint(run / "keyed"), _checkpoint(run / "torch"))


@pytest.mark.distributed
@pytest.mark.parametrize("run", ["two", "one"], ids=["2 processes resumed on 3",
                                                     "1 process resumed on 2"])
def test_a_run_resumed_on_another_process_count_equals_the_straight_run(single, launched, run):
    ckpt = torch.load(_checkpoint(launched / run), weights_only=True)
    assert ckpt["data_position"]["step"] == 6  # both epochs, resumed mid-epoch
    assert ckpt["config"]["resolved"]["world_size"] == (3 if run == "two" else 2)
    check_invariance(_checkpoint(single / "straight"), {run: _checkpoint(launched / run)},
                     reference32=_checkpoint(single / "straight32"),
                     negative64=_checkpoint(single / "straight_off"))
    assert max_diff(state(_checkpoint(single / "straight_off")),
                    state(_checkpoint(single / "straight"))) > APART
