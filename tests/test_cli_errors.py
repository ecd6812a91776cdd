"""A user's mistake is one line `tandem: error: ...` on stderr, exit status 2, no traceback."""

import os
import subprocess
import sys

import pytest

from tandem.strategies import strategy_names

pytestmark = pytest.mark.slow

TINY = ["--data", "synthetic", "--synthetic-size", "8", "--image-size", "8", "--num-classes",
        "2", "-b", "4", "--no-progress", "--max-steps", "1"]


def tandem(*argv, cwd=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "tandem", *argv], capture_output=True,
                          text=True, timeout=120, env=env, cwd=cwd)


def assert_one_line_error(result, *needles):
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("tandem: error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize("argv, needles", [
    (["--arch", "resnet_nope"], ["resnet_nope", "cifar_resnet20", "vgg11"]),  # lists valid ones
    (["--devices", "cpu:0"], ["cpu:0"]),
    (["--devices", "tpu"], ["tpu"]),
    (["--strategy", "nope"], ["nope", *strategy_names()]),  # lists the registered ones
    (["-b", "0"], ["--batch-size"]),
    (["--amp"], ["--amp", "CUDA"]),
    (["--resume", "no/such/checkpoint.pt"], ["no/such/checkpoint.pt"]),
])
def test_train_usage_errors(argv, needles, tmp_path):
    # Each default is overridden one at a time; the devices default (auto) is cpu here.
    argv = [*TINY, "--devices", "cpu", "--out", str(tmp_path / "out"), *argv]
    assert_one_line_error(tandem("train", *argv), *needles)
    assert not (tmp_path / "out" / "checkpoint.pt").exists()


def test_missing_data_path(tmp_path):
    missing = str(tmp_path / "no_such_dir")
    result = tandem("train", "--data", missing, "--devices", "cpu", "--out", str(tmp_path))
    assert_one_line_error(result, missing)


def test_corrupt_checkpoint_in_train_and_eval(tmp_path):
    bad = tmp_path / "corrupt.pt"
    bad.write_bytes(b"PK\x03\x04 this is not a zip archive at all" * 10)
    assert_one_line_error(tandem("train", *TINY, "--out", str(tmp_path / "o"), "--resume",
                                 str(bad)), str(bad))
    assert_one_line_error(tandem("eval", "--resume", str(bad)), str(bad))


def test_a_failed_resume_keeps_the_old_checkpoint(tmp_path):
    """A wrong --arch on resume is refused before anything is written."""
    out = tmp_path / "run"
    first = tandem("train", *TINY, "--devices", "cpu", "--out", str(out))
    assert first.returncode == 0, first.stderr
    before = (out / "checkpoint.pt").read_bytes()
    result = tandem("train", *TINY, "--devices", "cpu", "--out", str(out), "-a",
                    "cifar_resnet32", "--resume", str(out / "checkpoint.pt"))
    assert_one_line_error(result, "checkpoint.pt")
    assert (out / "checkpoint.pt").read_bytes() == before
