"""A user's mistake is one line `tandem: error: ...` on stderr, exit status 2, no traceback."""

import os
import subprocess
import sys
import warnings

import pytest

from tandem.cli.common import tandem_warnings
from tandem.cli.main import main
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
    (["--strategy", "nope"], ["nope", *strategy_names()]),  # lists the registered ones
])
def test_train_usage_errors(argv, needles, tmp_path):
    argv = [*TINY, "--devices", "cpu", "--out", str(tmp_path / "out"), *argv]
    assert_one_line_error(tandem("train", *argv), *needles)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, needles", [
    (["--devices", "tpu"], ["tpu"]),
    (["-b", "0"], ["--batch-size"]),
    (["--amp"], ["--amp", "CUDA"]),
    (["--channels-last"], ["--channels-last", "CUDA"]),
    (["--resume", "no/such/checkpoint.pt"], ["no/such/checkpoint.pt"]),
    (["--strategy", "hybrid", "--devices", "cpu:2"], ["features"]),  # a ResNet cannot be split
])
def test_more_usage_errors_in_process(argv, needles, tmp_path, capsys):
    """The same path as above (cli.main), without paying a process start per case."""
    if "--amp" in argv or "--channels-last" in argv:
        argv = [*argv, "--devices", "cpu"]
    code = main(["train", *TINY, "--out", str(tmp_path / "out"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("tandem: error: ") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, err
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


def test_single_with_several_devices_warns(tmp_path):
    with pytest.warns(UserWarning, match="strategy 'single' uses only cpu of the 2 devices"):
        code = main(["train", *TINY, "--devices", "cpu:2", "--out", str(tmp_path)])
    assert code == 0
    assert (tmp_path / "best.pt").exists()  # written at the first validation, even at 0%


def test_tandem_warnings_are_one_line_others_keep_their_format():
    import tandem.strategies.single as ours
    with tandem_warnings():
        mine = warnings.formatwarning("careful", UserWarning, ours.__file__, 3)
        theirs = warnings.formatwarning("careful", UserWarning, warnings.__file__, 3)
    assert mine == "tandem: warning: careful\n"
    assert warnings.__file__ in theirs
    assert warnings.formatwarning("x", UserWarning, ours.__file__, 3) != "tandem: warning: x\n"
