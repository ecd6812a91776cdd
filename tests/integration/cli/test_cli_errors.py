"""A user's mistake is one line `tandem: error: ...` on stderr (its remedy, where it has one, on
a `hint: ...` line under it), exit status 2, no traceback."""

import warnings

import pytest
from conftest import run_tandem

from tandem.cli.common import tandem_warnings
from tandem.cli.main import main
from tandem.strategies import strategy_names

pytestmark = pytest.mark.slow

TINY = ["--data", "synthetic", "--synthetic-size", "8", "--image-size", "8", "--num-classes",
        "2", "-b", "4", "--no-progress", "--max-steps", "1"]


def assert_one_line_error(result, *needles):
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert_error_line(result.returncode, result.stderr, *needles)


@pytest.mark.parametrize("argv, needles", [
    (["--arch", "resnet_nope"], ["resnet_nope", "did you mean", "`tandem models`"]),
    (["--arch", "zzz"], ["zzz", "cifar_resnet20", "vgg11"]),  # nothing close: lists them all
    (["--devices", "cpu:0"], ["cpu:0"]),
    (["--strategy", "nope"], ["nope", *strategy_names(), "or auto"]),  # lists them, and auto
    (["--strategy", "dpp"], ["unknown --strategy 'dpp': did you mean dp?"]),
])
def test_train_usage_errors(argv, needles, tmp_path, capsys):
    """Through cli.main in this process: the message is the CLI's, whatever the process;
    test_corrupt_checkpoint_in_eval_is_one_line_in_a_real_process checks a real exit."""
    argv = [*TINY, "--devices", "cpu", "--out", str(tmp_path / "out"), *argv]
    assert_error_line(*run_in_process(capsys, "train", *argv), *needles)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, needles", [
    (["--devices", "tpu"], ["tpu"]),
    (["-b", "0"], ["--batch-size"]),
    (["--amp", "--amp-dtype", "fp16"], ["--amp-dtype fp16", "CUDA"]),  # the CPU's is bf16
    (["--amp-dtype", "bf16"], ["--amp-dtype bf16 needs --amp"]),
    (["--resume", "no/such/checkpoint.pt"], ["no/such/checkpoint.pt"]),
    (["--strategy", "hybrid", "--devices", "cpu:2", "--hybrid-head", "head"],
     ["--strategy hybrid", "looked for .head on ResNet", "(its children: "]),
    (["--drop-path", "1.5"], ["bad --drop-path 1.5: must be in [0, 1)"]),
    (["--drop-path", "0.1", "-a", "alexnet"],
     ["--drop-path 0.1: alexnet has no residual blocks", "cifar_resnet20", "resnet50"]),
    (["--dropout-rng", "numpy"], ["bad --dropout-rng 'numpy': choose one of keyed, torch"]),
])
def test_more_usage_errors_in_process(argv, needles, tmp_path, capsys):
    """The same path as above (cli.main), without paying a process start per case."""
    if "--amp" in argv or "--channels-last" in argv:
        argv = [*argv, "--devices", "cpu"]
    code = main(["train", *TINY, "--out", str(tmp_path / "out"), *argv])
    assert_error_line(code, capsys.readouterr().err, *needles)
    assert not (tmp_path / "out" / "checkpoint.pt").exists()


def test_missing_data_path(tmp_path, capsys):
    missing = str(tmp_path / "no_such_dir")
    assert_error_line(*run_in_process(capsys, "train", "--data", missing, "--devices", "cpu",
                                      "--out", str(tmp_path)), missing)


def test_corrupt_checkpoint_in_train_is_one_line(tmp_path, capsys):
    bad = tmp_path / "corrupt.pt"
    bad.write_bytes(b"PK\x03\x04 this is not a zip archive at all" * 10)
    assert_error_line(*run_in_process(capsys, "train", *TINY, "--out", str(tmp_path / "o"),
                                      "--resume", str(bad)), str(bad))


def test_corrupt_checkpoint_in_eval_is_one_line_in_a_real_process(tmp_path):
    """The one check in a real `tandem` process: exit status 2 and one line on stderr, no
    traceback, for an error that torch raises deep in its loader."""
    bad = tmp_path / "corrupt.pt"
    bad.write_bytes(b"PK\x03\x04 this is not a zip archive at all" * 10)
    assert_one_line_error(run_tandem("eval", "--resume", str(bad), timeout=120), str(bad))


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


def test_a_message_of_many_lines_is_printed_as_its_first(capsys, monkeypatch):
    """A message that wraps a library's text (torch's run over several lines) is still one
    line, in full (not cut at the 200 characters of a bench's failure reason)."""
    from tandem.cli import models
    from tandem.errors import UsageError

    long = "could not join the job at 10.0.0.1:29500: " + "x" * 300

    def fail(args):
        raise UsageError(f"{long}\n  (torch's own detail)\nand more")

    monkeypatch.setattr(models, "run", fail)
    code, err = run_in_process(capsys, "models")
    assert_error_line(code, err, long)


def run_in_process(capsys, *argv):
    """``main(argv)``'s exit code (argparse's SystemExit included) and its stderr."""
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def assert_error_line(code, err, *needles):
    """One error line, maybe its ``hint:`` line, and each of ``needles`` in one of them."""
    assert code == 2 and "Traceback" not in err, (code, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert 1 <= len(lines) <= 2 and lines[0].startswith("tandem: error: "), err
    assert len(lines) == 1 or lines[1].startswith("hint: "), err
    for needle in needles:
        assert any(needle in line for line in lines), err


@pytest.mark.parametrize("argv", [
    ["--strategy", "dp", "-b", "1", "--devices", "cpu:2"],  # batch < devices: fewer replicas
    ["--strategy", "balanced", "-b", "3", "--devices", "cpu:4"],
])
def test_batch_smaller_than_device_count_trains(argv, tmp_path, capsys):
    code, err = run_in_process(capsys, "train", *TINY, "--max-steps", "2",
                               "--out", str(tmp_path), *argv)
    assert code == 0, err
    assert (tmp_path / "checkpoint.pt").exists()


@pytest.fixture
def earlier_run(tmp_path):
    """A run directory whose checkpoint must survive every failed command."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoint.pt").write_bytes(b"precious")
    return run


def make_bad_checkpoints(tmp_path):
    (tmp_path / "a_dir").mkdir()
    (tmp_path / "empty.pt").write_bytes(b"")
    (tmp_path / "text.pt").write_text("not a checkpoint\n")
    return [tmp_path / "a_dir", tmp_path / "empty.pt", tmp_path / "text.pt"]


def test_bad_resume_files_are_one_line_and_lose_nothing(earlier_run, tmp_path, capsys):
    for bad in make_bad_checkpoints(tmp_path):
        for cmd in (["train", *TINY, "--devices", "cpu", "--out", str(earlier_run)], ["eval"]):
            code, err = run_in_process(capsys, *cmd, "--resume", str(bad))
            assert_error_line(code, err, str(bad))
    assert (earlier_run / "checkpoint.pt").read_bytes() == b"precious"
    assert sorted(p.name for p in earlier_run.iterdir()) == ["checkpoint.pt"]


@pytest.mark.parametrize("argv, needles", [
    (["--epochs", "0"], ["--epochs"]),
    (["--lr", "-1"], ["--lr"]),
    # --overwrite gets past the --out check: bad data is still found before anything is cleared
    (["--data", "{empty}", "--overwrite"], ["{empty}", "empty"]),
])
def test_bad_values_lose_nothing(argv, needles, earlier_run, tmp_path, capsys):
    (tmp_path / "empty_data").mkdir()
    fill = lambda s: s.replace("{empty}", str(tmp_path / "empty_data"))  # noqa: E731
    code, err = run_in_process(capsys, "train", *TINY, "--devices", "cpu", "--out",
                               str(earlier_run), *map(fill, argv))
    assert_error_line(code, err, *map(fill, needles))  # the error alone, no warning
    assert (earlier_run / "checkpoint.pt").read_bytes() == b"precious"


def test_out_must_be_a_directory(tmp_path, capsys):
    regular = tmp_path / "notes.txt"
    regular.write_text("keep me")
    for out, needles in ((regular, [str(regular), "file"]),
                         (regular / "sub", [str(regular / "sub")])):
        code, err = run_in_process(capsys, "train", *TINY, "--devices", "cpu", "--out", str(out))
        assert_error_line(code, err, *needles)
    assert regular.read_text() == "keep me"


@pytest.mark.parametrize("argv, needles", [
    (["eval"], ["--resume"]),
    (["bench", "-a", "nosuch"], ["nosuch", "vgg11"]),
    (["trian", "--data", "digits"], ["unknown command 'trian': did you mean train? (see tandem "
                                     "--help)"]),
    (["xyz"], ["unknown command 'xyz'; choose one of train, eval, bench, launch, models"]),
])
def test_missing_or_unknown_commands(argv, needles, capsys):
    code, err = run_in_process(capsys, *argv)
    assert code == 2 and "Traceback" not in err, err
    assert "error:" in err.splitlines()[-1]  # argparse's own errors follow their usage line
    for needle in needles:
        assert needle in err.splitlines()[-1], err


def test_tandem_alone_prints_its_usage(capsys):
    """`tandem` with no command: its usage and commands, as git's, not an argparse error."""
    assert main([]) == 2
    printed = capsys.readouterr()
    assert printed.out.startswith("usage: tandem") and printed.err == ""
    for command in ("train", "eval", "bench", "launch", "models"):
        assert command in printed.out


def test_cuda_on_a_cpu_machine(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, err = run_in_process(capsys, "train", *TINY, "--devices", "cuda", "--out", str(tmp_path))
    assert_error_line(code, err, "cuda", "CUDA")
