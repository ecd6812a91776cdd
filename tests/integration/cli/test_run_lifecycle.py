"""A run directory's life in one process, compared with the same run never interrupted.

Resumes take their settings from the checkpoint; a resume must show (and is checked for) where
it continued: the `resuming` line, the batches it trained, one metrics row per epoch. Refused
commands and fresh runs into a run directory must leave every byte of it as it was. Runs go
through the CLI's ``main`` in this process; the Ctrl-C test runs a real subprocess.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import cli_env, default_sigint, ok, one_line_error, run_in_process, snapshot

pytestmark = pytest.mark.slow

# 20 synthetic 8x8 samples in global batches of 6: 4 batches (the last has 2) per epoch.
TINY = ["--data", "synthetic", "--synthetic-size", "20", "--image-size", "8", "--num-classes",
        "4", "-a", "cifar_resnet20", "-b", "6", "--seed", "3", "--epochs", "2", "--no-progress"]


def state(path) -> dict:
    return torch.load(path, weights_only=True)


def assert_bitwise_equal(a, b):
    sa, sb = state(a)["state_dict"], state(b)["state_dict"]
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def rows(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


STRATEGIES = {
    "dp": ["--strategy", "dp", "--devices", "cpu:2"],
    "balanced": ["--strategy", "balanced", "--devices", "cpu:2"],
    "dp-accum2": ["--strategy", "dp", "--devices", "cpu:2", "--accum-steps", "2"],
}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_no_flag_resume_equals_the_straight_run(name, tmp_path):
    """Stop mid-epoch 1 (--max-steps), then `--resume RUN` alone: bitwise the straight run."""
    args = [*TINY, *STRATEGIES[name], "-p", "1"]
    straight, run = tmp_path / "straight", tmp_path / "run"
    ok("train", *args, "--out", straight)
    ok("train", *args, "--max-steps", "1", "--out", run)
    before = state(run / "checkpoint.pt")["data_position"]
    accum = 2 if "accum" in name else 1
    assert before == {"epoch": 0, "batch": accum, "step": 1}

    proc = ok("train", "--resume", run)  # no other flag: the run's own settings
    first = proc.stdout.splitlines()[0]
    assert first.startswith(f"resuming {run / 'checkpoint.pt'} at epoch 1/2, step 1 "
                            f"({accum}/4 batches"), proc.stdout
    # It trained only what was left: 4 - accum batches of epoch 1, then 4 of epoch 2.
    assert proc.stdout.count("epoch 1/2 [") == 4 - accum and proc.stdout.count("epoch 2/2 [") == 4
    assert_bitwise_equal(straight / "checkpoint.pt", run / "checkpoint.pt")
    assert state(run / "checkpoint.pt")["data_position"] == {"epoch": 2, "batch": 0,
                                                            "step": 4 // accum * 2}
    # One row per epoch, equal to the straight run's (the partial row of the stop replaced).
    got, want = rows(run), rows(straight)
    assert [r["epoch"] for r in got] == [1, 2]
    for g, w in zip(got, want):
        for key in ("step", "batches", "train_loss", "train_acc", "val_loss", "val_acc", "lr"):
            assert g[key] == w[key], key


def test_refused_changes_leave_the_run_untouched(tmp_path):
    run = tmp_path / "run"
    ok("train", *TINY, "--strategy", "dp", "--devices", "cpu:2", "--max-steps", "2",
       "--out", run)
    before = snapshot(run)
    for flag, value, old in (("-b", "8", "6"), ("--accum-steps", "2", "1"),
                             ("--seed", "4", "3"), ("--data", "digits", "synthetic"),
                             ("-a", "cifar_resnet32", "cifar_resnet20")):
        proc = run_in_process("train", "--resume", run, flag, value)
        line = one_line_error(proc, "another --out")
        long_flag = {"-b": "--batch-size", "-a": "--arch"}.get(flag, flag)
        assert line.startswith(f"tandem: error: {long_flag} {value} would change the run")
        assert f"which has {long_flag} {old}" in line
        assert snapshot(run) == before  # byte-identical, not even rewritten


def test_allowed_changes_are_said_and_kept(tmp_path):
    run = tmp_path / "run"
    ok("train", *TINY, "--epochs", "1", "--out", run, "--devices", "cpu")
    proc = ok("train", "--resume", run, "--epochs", "2", "--strategy", "dp", "--devices",
              "cpu:2", "-b", "6")  # -b equal to the run's value is no change
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"resuming {run / 'checkpoint.pt'} at epoch 2/2, step 4")
    assert "  --epochs 2: the learning-rate schedule now spans 2 epochs (was 1)" in lines
    assert "  --strategy dp (the run had single)" in lines
    assert "  --devices cpu:2 (the run had cpu)" in lines
    assert not any("batch-size" in line for line in lines)
    config = json.loads((run / "config.json").read_text())
    assert config["optim"]["epochs"] == 2 and config["parallel"]["strategy"] == "dp"
    assert [r["epoch"] for r in rows(run)] == [1, 2]


def test_fork_into_a_new_directory_keeps_the_original(tmp_path):
    run, fork = tmp_path / "run", tmp_path / "fork"
    ok("train", *TINY, "--epochs", "1", "--out", run, "--devices", "cpu")
    before = snapshot(run)
    proc = ok("train", "--resume", run, "--epochs", "2", "--out", fork)
    assert f"  --out {fork}: a new run directory, forked from '{run}'" in proc.stdout
    assert snapshot(run) == before
    assert [r["epoch"] for r in rows(fork)] == [1, 2]
    assert state(fork / "checkpoint.pt")["data_position"]["epoch"] == 2


def test_fresh_run_into_a_run_directory_is_refused_and_best_pt_survives(tmp_path):
    run = tmp_path / "run"
    ok("train", *TINY, "--out", run, "--devices", "cpu")
    best = (run / "best.pt").read_bytes()
    before = snapshot(run)
    acc = max(r["val_acc"] for r in rows(run))
    proc = run_in_process("train", *TINY, "--lr", "0.5", "--out", run, "--devices", "cpu")
    one_line_error(proc, f"already holds a run (2 epoch(s), best val acc {acc:.2f}%)")
    for choice in (f"--resume {run}", "another --out", "--overwrite"):
        assert choice in proc.stderr
    assert snapshot(run) == before
    # --overwrite replaces it: a new history, written from scratch.
    ok("train", *TINY, "--epochs", "1", "--out", run, "--devices", "cpu", "--overwrite")
    assert [r["epoch"] for r in rows(run)] == [1]
    assert (run / "best.pt").read_bytes() != best


def test_metrics_never_hold_nan_and_curves_use_whole_epochs(tmp_path):
    from tandem.train.metrics import MetricsLog

    log = MetricsLog(str(tmp_path / "metrics.jsonl"), keep_epochs=None)
    log.append({"epoch": 1, "train_loss": float("nan"), "val_acc": float("inf")})
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text) == {"epoch": 1, "train_loss": None, "val_acc": None}


def test_save_every_writes_mid_epoch_checkpoints(tmp_path, monkeypatch):
    """--save-every N: the Trainer writes checkpoint.pt at steps N, 2N, ... inside an epoch.

    Every write the Trainer makes goes through ``tandem.checkpoint.save``; a spy records each
    one, with the file as written. Without --save-every (the control) only the epoch ends
    write, so the mid-epoch writes are the flag's own doing (an epoch end or a --max-steps stop
    would write a checkpoint just as well).
    """
    import tandem.checkpoint

    real_save, writes = tandem.checkpoint.save, []

    def spy(path, *args, **kwargs):
        written = real_save(path, *args, **kwargs)
        ckpt = state(path)
        progress = ckpt.get("epoch_progress")
        writes.append((os.path.basename(path), ckpt["data_position"],
                       progress and progress["count"]))
        return written

    monkeypatch.setattr(tandem.checkpoint, "save", spy)

    def checkpoint_writes(run, *flags):
        writes.clear()
        ok("train", *TINY, *flags, "--out", run, "--devices", "cpu")
        return [(pos["epoch"], pos["batch"], pos["step"], count)
                for name, pos, count in writes if name == "checkpoint.pt"]

    # 2 epochs of 4 batches, --save-every 2: mid-epoch at steps 2 and 6 (step 4 and step 8
    # are epoch ends, written once each), each with the epoch's train sums so far (2 batches
    # of 6 samples).
    assert checkpoint_writes(tmp_path / "every2", "--save-every", "2") == [
        (0, 2, 2, 12), (1, 0, 4, None), (1, 2, 6, 12), (2, 0, 8, None)]
    # --save-every 1 with a --max-steps stop at step 3: steps 1 and 2, then the stop's own.
    assert checkpoint_writes(tmp_path / "every1", "--epochs", "1", "--save-every", "1",
                             "--max-steps", "3") == [
        (0, 1, 1, 6), (0, 2, 2, 12), (0, 3, 3, 18)]
    # The control: without the flag, only the epoch ends write.
    assert checkpoint_writes(tmp_path / "never") == [(1, 0, 4, None), (2, 0, 8, None)]


DROPOUT_RUN = ["--data", "synthetic", "--synthetic-size", "8", "--image-size", "8",
               "--num-classes", "4", "-a", "dropout_net:make", "--dropout", "0.5", "-b", "4",
               "--seed", "3", "--epochs", "1", "--no-progress", "--strategy", "single",
               "--devices", "cpu"]


def test_resume_restores_the_global_rng_that_dropout_draws_from(tmp_path):
    """Interrupted and resumed == the straight run, bitwise, where the steps after the resume
    draw from torch's global RNG: the dropout masks of tests/support/dropout_net.py under
    ``--dropout-rng torch`` (nn.Dropout, as alexnet's and vgg's, in a model of a few hundred
    weights; `single`, as torch's dropout in CPU replica threads is not bit-reproducible).

    The data cannot carry this: the sampler and the augmentation are keyed by seed, epoch and
    sample. The control resumes the same checkpoint without its ``rng`` entry: the masks after
    the resume are then drawn from the state the model's seeded initialisation left, and the
    weights differ, so the comparison depends on the RNG restore.
    """
    args = [*DROPOUT_RUN, "--dropout-rng", "torch"]
    straight, run, no_rng = tmp_path / "straight", tmp_path / "run", tmp_path / "no_rng"
    ok("train", *args, "--out", straight)
    ok("train", *args, "--max-steps", "1", "--out", run)
    ckpt = state(run / "checkpoint.pt")
    assert ckpt["data_position"] == {"epoch": 0, "batch": 1, "step": 1}
    del ckpt["rng"]
    no_rng.mkdir()
    torch.save(ckpt, no_rng / "stopped.pt")

    proc = ok("train", "--resume", run)
    assert proc.stdout.startswith(f"resuming {run / 'checkpoint.pt'} at epoch 1/1, step 1 ")
    assert_bitwise_equal(straight / "checkpoint.pt", run / "checkpoint.pt")

    ok("train", "--resume", no_rng / "stopped.pt", "--out", no_rng / "run")
    a = state(straight / "checkpoint.pt")["state_dict"]
    b = state(no_rng / "run" / "checkpoint.pt")["state_dict"]
    assert state(no_rng / "run" / "checkpoint.pt")["data_position"]["step"] == 2
    assert not torch.equal(a["5.weight"], b["5.weight"])


def test_a_resume_under_keyed_dropout_needs_no_rng_state(tmp_path):
    """Keyed dropout (the default) draws from the seed and the step: interrupted and resumed ==
    the straight run bitwise, also resumed from the checkpoint without its ``rng`` entry, and
    the checkpoint holds what it held before (nothing new to save). The control: under
    ``--dropout-rng torch`` the same resume without ``rng`` differs (the test above)."""
    straight, run, no_rng = tmp_path / "straight", tmp_path / "run", tmp_path / "no_rng"
    ok("train", *DROPOUT_RUN, "--out", straight)
    ok("train", *DROPOUT_RUN, "--max-steps", "1", "--out", run)
    ckpt = state(run / "checkpoint.pt")
    torch_run = tmp_path / "torch"
    ok("train", *DROPOUT_RUN, "--dropout-rng", "torch", "--max-steps", "1", "--out", torch_run)
    assert ckpt.keys() == state(torch_run / "checkpoint.pt").keys()
    del ckpt["rng"]
    no_rng.mkdir()
    torch.save(ckpt, no_rng / "stopped.pt")
    ok("train", "--resume", run)
    assert_bitwise_equal(straight / "checkpoint.pt", run / "checkpoint.pt")
    ok("train", "--resume", no_rng / "stopped.pt", "--out", no_rng / "run")
    a = state(straight / "checkpoint.pt")["state_dict"]
    b = state(no_rng / "run" / "checkpoint.pt")["state_dict"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["5.weight"], state(torch_run / "checkpoint.pt")["state_dict"]
                           ["5.weight"])  # keyed and torch's draws: other masks


def test_a_run_saved_before_dropout_was_keyed_goes_on_with_torchs_draws(tmp_path):
    """A checkpoint whose config has no ``dropout_rng`` (saved before keyed dropout) resumes
    with ``--dropout-rng torch``, the draws it was trained with: bitwise the straight torch
    run (resumed keyed, the default, its later masks would differ)."""
    straight, run = tmp_path / "straight", tmp_path / "run"
    ok("train", *DROPOUT_RUN, "--dropout-rng", "torch", "--out", straight)
    ok("train", *DROPOUT_RUN, "--dropout-rng", "torch", "--max-steps", "1", "--out", run)
    ckpt = state(run / "checkpoint.pt")
    del ckpt["config"]["model"]["dropout_rng"]
    torch.save(ckpt, run / "checkpoint.pt")
    config = json.loads((run / "config.json").read_text())
    del config["model"]["dropout_rng"]
    (run / "config.json").write_text(json.dumps(config))
    ok("train", "--resume", run)
    assert state(run / "checkpoint.pt")["config"]["model"]["dropout_rng"] == "torch"
    assert_bitwise_equal(straight / "checkpoint.pt", run / "checkpoint.pt")


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_ctrl_c_saves_mid_epoch_and_says_how_to_continue(tmp_path):
    """Ctrl-C after a few steps of a long epoch: saved at that step, not at an epoch end."""
    run, log = tmp_path / "run", tmp_path / "stdout.log"
    long_epoch = [*TINY[:3], "6000", *TINY[4:], "-p", "1"]  # 1000 batches per epoch
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tandem", "train", *long_epoch,
                                 "--devices", "cpu", "--out", str(run)], stdout=out,
                                stderr=subprocess.PIPE, text=True, env=cli_env(),
                                preexec_fn=default_sigint)
    try:
        deadline = time.monotonic() + 240
        while "[3/1000]" not in log.read_text():  # step 3 has been trained
            assert proc.poll() is None and time.monotonic() < deadline, "no step 3"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    ckpt = state(run / "checkpoint.pt")
    position = ckpt["data_position"]
    assert position["epoch"] == 0 and 3 <= position["batch"] < 1000, position
    assert (f"tandem: interrupted; saved {run / 'checkpoint.pt'} at epoch 1, step "
            f"{position['step']}; continue with: tandem train --resume {run}") in err
    assert "Traceback" not in err
    proc = ok("train", "--resume", run, "--max-steps", position["step"] + 1)
    assert proc.stdout.startswith(f"resuming {run / 'checkpoint.pt'} at epoch 1/2, step "
                                  f"{position['step']} ")
    assert state(run / "checkpoint.pt")["data_position"]["step"] == position["step"] + 1
    assert os.path.exists(run / "best.pt")
