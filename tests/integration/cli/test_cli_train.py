"""`tandem train` end to end through the CLI: outputs, exact resume, strategy invariance,
errors. Runs go through ``main`` in this process; `tandem launch` runs as a real subprocess.

Runs are tiny (synthetic 8x8 images, a few steps) so that each takes a few seconds.
"""

import json

import pytest
import torch
from conftest import ok, one_line_error, run_in_process, run_tandem, succeeded
from exact import check_invariance

pytestmark = pytest.mark.slow

# A small run: 20 train samples in batches of 6 (4 global batches, the last one short: 2).
TINY = ["--data", "synthetic", "--synthetic-size", "20", "--image-size", "8",
        "--num-classes", "4", "-a", "cifar_resnet20", "-b", "6", "--no-progress", "--seed", "3"]


def weights(path):
    return torch.load(path, weights_only=True)["state_dict"]


def assert_same_weights(a, b, atol=1e-5):
    sa, sb = weights(a), weights(b)
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.allclose(sa[key].double(), sb[key].double(), atol=atol, rtol=1e-4), key


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Two straight epochs with the step schedule (the imagenet example's: epoch-count free)."""
    out = tmp_path_factory.mktemp("straight")
    ok("train", *TINY, "--epochs", "2", "--lr-schedule", "step", "--lr-step", "1",
       "--augment", "standard", "--out", str(out))
    return out


def test_outputs(straight):
    records = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2]
    for r in records:
        for key in ("epoch", "train_loss", "val_loss", "val_acc", "images_per_sec", "seconds"):
            assert isinstance(r[key], (int, float)), key
        assert 0 <= r["val_acc"] <= 100 and r["seconds"] > 0
        assert r["peak_memory_mb"] is None  # the CPU reports no peak memory
    assert (straight / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    config = json.loads((straight / "config.json").read_text())
    assert config["optim"]["batch_size"] == 6 and config["resolved"]["devices"] == ["cpu"]
    for name in ("checkpoint.pt", "best.pt"):
        ckpt = torch.load(straight / name, weights_only=True)  # no code, only data
        for key in ("epoch", "arch", "state_dict", "best_acc1", "optimizer", "scheduler",
                    "rng", "data_position", "config"):
            assert key in ckpt, key
    ckpt = torch.load(straight / "checkpoint.pt", weights_only=True)
    assert ckpt["epoch"] == 2 and ckpt["arch"] == "cifar_resnet20"
    assert ckpt["data_position"] == {"epoch": 2, "batch": 0, "step": 8}
    assert not any(k.startswith("module.") for k in ckpt["state_dict"])
    assert any(k.endswith("running_mean") for k in ckpt["state_dict"])


def test_resuming_with_the_wrong_arch_is_refused_and_loses_nothing(straight, tmp_path):
    ckpt = tmp_path / "checkpoint.pt"
    ckpt.write_bytes((straight / "checkpoint.pt").read_bytes())
    before = ckpt.read_bytes()
    result = run_in_process("train", *TINY, "-a", "cifar_resnet32", "--resume", str(ckpt),
                            "--epochs", "3", "--out", str(tmp_path))
    one_line_error(result, str(ckpt))
    assert ckpt.read_bytes() == before and not (tmp_path / "metrics.jsonl").exists()


def test_one_epoch_plus_resumed_epoch_equals_two(straight, tmp_path):
    ok("train", *TINY, "--epochs", "1", "--lr-schedule", "step", "--lr-step", "1",
       "--augment", "standard", "--out", str(tmp_path))
    result = ok("train", "--epochs", "2", "--resume", str(tmp_path / "checkpoint.pt"))
    assert result.stdout.startswith(f"resuming {tmp_path / 'checkpoint.pt'} at epoch 2/2, "
                                    "step 4 (0/4 batches of the epoch done)"), result.stdout
    assert "epoch 1/2" not in result.stdout  # epoch 1 was not trained again
    assert_same_weights(straight / "checkpoint.pt", tmp_path / "checkpoint.pt", atol=1e-6)
    epochs = [json.loads(x)["epoch"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert epochs == [1, 2]


def test_mid_epoch_max_steps_stop_then_resume_is_exact(straight, tmp_path):
    """Stop after 3 of the 4 steps of epoch 1, save, resume: the same as never stopping."""
    args = [*TINY, "--epochs", "2", "--lr-schedule", "step", "--lr-step", "1",
            "--augment", "standard", "--out", str(tmp_path)]
    ok("train", *args, "--max-steps", "3")
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert ckpt["data_position"] == {"epoch": 0, "batch": 3, "step": 3}
    result = ok("train", *args, "--resume", str(tmp_path / "checkpoint.pt"))
    assert result.stdout.startswith(f"resuming {tmp_path / 'checkpoint.pt'} at epoch 1/2, "
                                    "step 3 (3/4 batches of the epoch done)"), result.stdout
    assert_same_weights(straight / "checkpoint.pt", tmp_path / "checkpoint.pt", atol=1e-6)
    epochs = [json.loads(x)["epoch"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert epochs == [1, 2]  # the partial row of the stop was replaced by the whole epoch's


STEPS = ["--epochs", "2", "--max-steps", "3"]
F64 = ["--dtype", "float64"]  # well-posed comparisons: see tests/support/exact.py


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    """single in float64, with the two controls of tests/support/exact.py: the same run in float32
    (noise floor) and dp without --sync-bn (a different update)."""
    out = tmp_path_factory.mktemp("single")
    ok("train", *TINY, *STEPS, *F64, "--strategy", "single", "--devices", "cpu",
       "--out", str(out / "f64"))
    ok("train", *TINY, *STEPS, "--strategy", "single", "--devices", "cpu", "--out", str(out / "f32"))
    ok("train", *TINY, *STEPS, *F64, "--strategy", "dp", "--devices", "cpu:3",
       "--out", str(out / "negative"))
    return out


def assert_matches_single(single_run, candidate):
    check_invariance(single_run / "f64" / "checkpoint.pt", {"candidate": candidate},
                     reference32=single_run / "f32" / "checkpoint.pt",
                     negative64=single_run / "negative" / "checkpoint.pt")


@pytest.mark.parametrize("strategy", [
    ["--strategy", "dp", "--sync-bn", "--devices", "cpu:3"],  # chunks 2+2+2, then 1+1 (short)
    ["--strategy", "balanced", "--sync-bn", "--devices", "cpu:2"],
    ["--strategy", "dp", "--sync-bn", "--devices", "cpu:4", "--buffers", "average"],
])
def test_strategies_reach_the_same_weights(single_run, strategy, tmp_path):
    ok("train", *TINY, *STEPS, *F64, *strategy, "--out", str(tmp_path))
    assert_matches_single(single_run, tmp_path / "checkpoint.pt")


@pytest.mark.distributed
def test_two_process_ddp_reaches_the_same_weights(single_run, tmp_path):
    succeeded(run_tandem("launch", "--nproc-per-node", "2", "--", "train", *TINY, *STEPS, *F64,
                         "--strategy", "ddp", "--sync-bn", "--devices", "cpu", "--out",
                         str(tmp_path), timeout=240, PYTHONWARNINGS="ignore"))
    assert_matches_single(single_run, tmp_path / "checkpoint.pt")


def test_gradient_accumulation_is_strategy_invariant(tmp_path):
    """--accum-steps 2: two global batches per step, the same under single and dp."""
    args = [*TINY, "--epochs", "1", "--accum-steps", "2"]
    for name, extra in {"a": ["--strategy", "single", "--devices", "cpu", *F64],
                        "a32": ["--strategy", "single", "--devices", "cpu"],
                        "b": ["--strategy", "dp", "--sync-bn", "--devices", "cpu:2", *F64],
                        "negative": ["--strategy", "dp", "--devices", "cpu:2", *F64]}.items():
        ok("train", *args, *extra, "--out", str(tmp_path / name))
    check_invariance(tmp_path / "a" / "checkpoint.pt", {"dp": tmp_path / "b" / "checkpoint.pt"},
                     reference32=tmp_path / "a32" / "checkpoint.pt",
                     negative64=tmp_path / "negative" / "checkpoint.pt")
    ckpt = torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=True)
    assert ckpt["data_position"]["step"] == 2  # 4 global batches, 2 per optimizer step
