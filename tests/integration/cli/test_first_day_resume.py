"""`tandem train --resume` where a user first meets it (issue 25), against what the run holds.

A resume with nothing to do says so in one line; one that would shorten or roll back the run is
refused in one line; a refused or finished resume leaves every byte of the run as it was. Runs
go through the CLI's ``main`` in this process; the `ddp` run is a real `tandem launch`.
"""

import json
import re
import shutil
import warnings

import pytest
import torch
from conftest import ok, run_in_process, run_tandem, snapshot

pytestmark = pytest.mark.slow

# 20 synthetic 8x8 samples in global batches of 6: 4 batches (4 optimizer steps) per epoch.
TINY = ["--data", "synthetic", "--synthetic-size", "20", "--image-size", "8", "--num-classes",
        "4", "-a", "cifar_resnet20", "-b", "6", "--seed", "3", "--epochs", "2", "--no-progress"]


def refused(*argv) -> str:
    """The one error line of a refused command (exit status 2)."""
    proc = run_in_process(*argv)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr)
    assert lines[0].startswith("tandem: error: ") and proc.stdout == "", proc.stdout
    return lines[0]


def position(run) -> dict:
    return torch.load(run / "checkpoint.pt", weights_only=True)["data_position"]


def epochs_logged(run) -> list[int]:
    return [json.loads(x)["epoch"] for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def complete(tmp_path_factory):
    """A run that has done both of its 2 epochs (step 8)."""
    run = tmp_path_factory.mktemp("complete") / "run"
    ok("train", *TINY, "--devices", "cpu", "--out", run)
    return run


def copy_of(run, tmp_path):
    return shutil.copytree(run, tmp_path / "run")


def test_a_complete_run_says_so_in_one_line_and_writes_nothing(complete, tmp_path):
    """Item 1: one line, first, exit 0 (nothing failed), and how to extend it; --max-steps
    on a complete run gets the same line (item 3), not `step 8/3`."""
    run = copy_of(complete, tmp_path)
    before = snapshot(run)
    best = torch.load(run / "best.pt", weights_only=True)["best_acc1"]
    for extra in ([], ["--max-steps", "3"], ["--strategy", "dp", "--devices", "cpu:2"]):
        proc = run_in_process("train", "--resume", run, *extra)
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
        assert proc.stdout.splitlines() == [
            f"run '{run}' is complete (2/2 epochs, step 8, best val acc {float(best):.2f}%); "
            f"to train it further, give it more epochs: tandem train --resume {run} "
            f"--epochs N (N > 2)"], proc.stdout
        assert snapshot(run) == before  # not even rewritten
    ok("train", "--resume", run, "--epochs", "3")  # the line's advice works
    assert position(run)["epoch"] == 3 and epochs_logged(run) == [1, 2, 3]


def test_fewer_epochs_than_done_is_refused_and_writes_nothing(complete, tmp_path):
    """Item 2: --epochs below the epochs done (whole, or begun) is one line, exit 2."""
    run = copy_of(complete, tmp_path)
    before = snapshot(run)
    line = refused("train", "--resume", run, "--epochs", "1")
    assert line == (f"tandem: error: --epochs 1 is fewer than run '{run}' has done (2 epochs); "
                    f"give --epochs 3 or more to train it further")
    assert snapshot(run) == before
    # Stopped in epoch 2: --epochs 1 would drop the half epoch trained.
    mid = tmp_path / "mid"
    ok("train", *TINY, "--devices", "cpu", "--max-steps", "6", "--out", mid)
    before = snapshot(mid)
    line = refused("train", "--resume", mid, "--epochs", "1")
    assert "(1 epoch and 2 batches of epoch 2); give --epochs 2 or more" in line
    assert snapshot(mid) == before
    ok("train", "--resume", mid, "--epochs", "2")  # what it advises is accepted
    assert position(mid) == {"epoch": 2, "batch": 0, "step": 8}


def test_max_steps_belongs_to_one_invocation(tmp_path):
    """Item 3: --max-steps counts the run's steps from its start; it is never stored, so a
    resume without it trains on; behind the run it is one line, exit 2, nothing written."""
    run = tmp_path / "run"
    ok("train", *TINY, "--devices", "cpu", "--max-steps", "6", "--out", run)

    def stored(run):
        config = json.loads((run / "config.json").read_text())
        saved = torch.load(run / "checkpoint.pt", weights_only=True)["config"]
        return [c["optim"].get("max_steps", "absent") for c in (config, saved)]

    assert stored(run) == ["absent", "absent"]
    before = snapshot(run)
    line = refused("train", "--resume", run, "--max-steps", "3")
    assert line == (f"tandem: error: --max-steps 3: run '{run}' has already made 6 optimizer "
                    f"steps (--max-steps counts them from the run's start); give more, e.g. "
                    f"--max-steps 9 for 3 more")
    assert snapshot(run) == before
    proc = ok("train", "--resume", run, "--max-steps", "7")
    assert "step 7/" not in proc.stdout and position(run)["step"] == 7
    assert stored(run) == ["absent", "absent"]
    ok("train", "--resume", run)  # does not inherit --max-steps 7: trains to the end
    assert position(run) == {"epoch": 2, "batch": 0, "step": 8}


def test_best_pt_into_its_own_run_is_refused_and_forks_elsewhere(complete, tmp_path):
    """Item 5: --resume RUN/best.pt would overwrite RUN's later checkpoint.pt: refused in one
    line naming both ways on; the fork it names works and leaves RUN as it was."""
    run = copy_of(complete, tmp_path)
    before = snapshot(run)
    for out in ([], ["--out", run]):
        line = refused("train", "--resume", run / "best.pt", "--epochs", "3", *out)
        assert line == (f"tandem: error: --resume {run / 'best.pt'} would roll run '{run}' back "
                        f"to best.pt and overwrite its latest checkpoint.pt: continue the latest "
                        f"with `tandem train --resume {run}`, or fork from best.pt with "
                        f"`tandem train --resume {run / 'best.pt'} --out NEWDIR`")
        assert snapshot(run) == before
    fork = tmp_path / "fork"
    proc = ok("train", "--resume", run / "best.pt", "--out", fork, "--epochs", "3")
    assert f"  --out {fork}: a new run directory, forked from '{run}'" in proc.stdout
    assert snapshot(run) == before and position(fork)["epoch"] == 3


def test_devices_the_new_strategy_cannot_drive_are_dropped_and_said(tmp_path):
    """Item 6: the run's cpu:2 under --strategy single becomes cpu, in one note and no warning;
    --devices typed on this command line keeps the warning."""
    run = tmp_path / "run"
    ok("train", *TINY, "--strategy", "dp", "--devices", "cpu:2", "--max-steps", "1",
       "--out", run)
    shutil.copytree(run, tmp_path / "typed")
    for typed in ([], ["--devices", "cpu:2"]):
        target = tmp_path / "typed" if typed else run
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            proc = ok("train", "--resume", target, "--strategy", "single", "--max-steps", "2",
                      *typed)
        warned = [str(w.message) for w in caught if "strategy 'single' uses only" in
                  str(w.message)]
        note = "  --devices cpu (the run had cpu:2; --strategy single drives 1 device)"
        assert (note in proc.stdout.splitlines()) == (not typed), proc.stdout
        assert len(warned) == (1 if typed else 0), warned
    config = json.loads((run / "config.json").read_text())["parallel"]
    assert config == {**config, "strategy": "single", "devices": "cpu"}


@pytest.mark.distributed
def test_a_ddp_run_resumed_without_launch_says_how(tmp_path):
    """Item 10: the run's process count, its launch command and a one-process strategy that
    takes its optimizer state; both printed commands continue the run."""
    run = tmp_path / "run"
    proc = run_tandem("launch", "--nproc-per-node", "2", "--", "train", *TINY, "--strategy",
                      "ddp", "--devices", "cpu", "--max-steps", "2", "--out", run,
                      timeout=240, PYTHONWARNINGS="ignore")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (run / "run.lock").exists()  # rank 0 took it, rank 1 let it be, and it is gone
    shutil.copytree(run, tmp_path / "copy")
    before = snapshot(run)
    line = refused("train", "--resume", run)
    assert line == (f"tandem: error: run '{run}' ran as 2 ddp processes: continue it with "
                    f"`tandem launch --nproc-per-node 2 -- train --resume {run}`, or in this one "
                    f"process with `tandem train --resume {run} --strategy dp --devices cpu:2`")
    assert snapshot(run) == before
    launch, alone = re.findall(r"`tandem ([^`]*)`", line)
    ok(*alone.split())
    assert position(run) == {"epoch": 2, "batch": 0, "step": 8}
    proc = run_tandem(*launch.replace(str(run), str(tmp_path / "copy")).split(), timeout=240,
                      PYTHONWARNINGS="ignore")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert position(tmp_path / "copy") == {"epoch": 2, "batch": 0, "step": 8}


def test_max_steps_behind_a_file_from_elsewhere_is_refused(tmp_path):
    """Item 3 for a file without tandem's position (the imagenet example's, at epoch 3): its
    steps are known once the data is, and --max-steps behind them is refused all the same."""
    from tandem.models import create_model

    model = create_model("cifar_resnet20", num_classes=4)
    torch.save({"arch": "cifar_resnet20", "epoch": 3, "state_dict": model.state_dict()},
               tmp_path / "file.pth.tar")
    args = [*TINY, "--epochs", "4", "--resume", tmp_path / "file.pth.tar", "--out",
            tmp_path / "out"]
    line = refused("train", *args, "--max-steps", "2")
    assert line.startswith(f"tandem: error: --max-steps 2: '{tmp_path / 'file.pth.tar'}' has "
                           f"already made 12 optimizer steps"), line
    assert not (tmp_path / "out").exists()
    ok("train", *args, "--max-steps", "13")
    assert position(tmp_path / "out") == {"epoch": 3, "batch": 1, "step": 13}
