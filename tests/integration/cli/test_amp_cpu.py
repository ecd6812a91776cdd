"""--amp (bf16) and --channels-last on the CPU, compared against the same runs in float32.

Tolerance: bf16 keeps 8 bits of mantissa (relative rounding about 4e-3 per operation), so a
few steps of a tiny net in bf16 autocast land within a few hundredths of fp32's loss.
"""

import json

import pytest
import torch
from conftest import ok, run_tandem, succeeded
from torch import nn

import tandem.precision
from tandem_bench import BenchConfig, format_table, run_bench
from tandem_bench.contestants import TrainStep
from tandem.cli.main import main
from tandem.errors import UsageError
from tandem.distributed.env import cpu_bf16_override
from tandem.precision import amp_precision, amp_refusal

TINY = ["--data", "synthetic", "--synthetic-size", "20", "--image-size", "8", "--num-classes",
        "4", "-a", "cifar_resnet20", "-b", "6", "--no-progress", "--seed", "3"]
FAST = ["--amp", "--channels-last"]
BF16_LOSS_TOL = 0.05  # absolute, on a cross-entropy of about 1.4 (4 classes)


def epoch_row(out, epoch: int) -> dict:
    """The ``metrics.jsonl`` row of ``epoch`` (1-based) in run directory ``out``."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["epoch"] == epoch][-1]


# -- what --amp means ------------------------------------------------------------------------
def test_amp_is_bf16_without_scaling_on_the_cpu_and_fp16_with_scaling_on_cuda():
    cpu = amp_precision("cpu", True, cpu_bf16=True)
    assert (cpu.dtype, cpu.scaled) == (torch.bfloat16, False)
    assert (amp_precision("cuda", True).dtype, amp_precision("cuda", True).scaled) == (
        torch.float16, True)
    assert amp_precision("cuda", True, "bf16").scaled is False
    assert amp_precision("cpu", False).dtype is None  # fp32: no autocast at all
    with pytest.raises(UsageError, match="fp16 is for CUDA"):
        amp_precision("cpu", True, "fp16", cpu_bf16=True)


def test_a_cpu_without_bf16_is_refused_in_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(tandem.precision, "cpu_flags", lambda: frozenset({"avx2"}))
    monkeypatch.delenv("TANDEM_CPU_BF16")
    for argv in (["train", *TINY, "--amp", "--devices", "cpu", "--out", str(tmp_path / "o")],
                 ["bench", "-a", "cifar_resnet20", "--devices", "cpu", "--amp"],
                 ["bench", "-a", "cifar_resnet20", "--devices", "cpu", "--variants", "fp32,amp"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        error, hint = err.splitlines()  # the error, and what to do on a line of its own
        assert "needs bf16 instructions" in error and "avx512_bf16" in error, err
        assert hint.startswith("hint: run without --amp") and "TANDEM_CPU_BF16=1" in hint
    assert not (tmp_path / "o").exists()


# -- tandem train / eval -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same 1-epoch run in fp32 and with --amp --channels-last, then resumed to 2 epochs."""
    out = tmp_path_factory.mktemp("amp")
    for name, extra in {"fp32": [], "fast": FAST}.items():
        ok("train", *TINY, "--epochs", "1", "--devices", "cpu", *extra,
           "--out", out / name)
    ok("train", "--resume", out / "fast", "--epochs", "2")
    return out


def test_amp_channels_last_trains_close_to_fp32(runs):
    fp32, fast = epoch_row(runs / "fp32", 1), epoch_row(runs / "fast", 1)
    for key in ("train_loss", "val_loss"):
        assert abs(fast[key] - fp32[key]) < BF16_LOSS_TOL, (key, fast[key], fp32[key])


def test_its_checkpoint_is_float32_resumes_and_loads_in_an_fp32_eval(runs):
    ckpt = torch.load(runs / "fast" / "checkpoint.pt", weights_only=True)
    assert ckpt["epoch"] == 2  # resumed from 1
    assert ckpt["config"]["parallel"]["amp"] is True
    floats = [t for t in ckpt["state_dict"].values() if t.is_floating_point()]
    assert floats and all(t.dtype == torch.float32 for t in floats)

    evals = {}
    for name, extra in {"amp": FAST, "fp32": ["--no-amp"]}.items():  # else: the run's amp
        result = ok("eval", "--resume", runs / "fast" / "checkpoint.pt",
                    "--devices", "cpu", "--json", *extra)
        evals[name] = json.loads(result.stdout.strip().splitlines()[-1])
    assert evals["fp32"]["count"] == evals["amp"]["count"]
    assert abs(evals["fp32"]["loss"] - evals["amp"]["loss"]) < BF16_LOSS_TOL


OWN = ["-a", "own_model:make_net", "--data", "own_model:pairs", "-b", "7", "--no-progress"]


@pytest.mark.parametrize("strategy", [
    [*TINY, "--strategy", "single", "--devices", "cpu"],
    [*TINY, "--strategy", "dp", "--devices", "cpu:2"],
    [*TINY, "--strategy", "balanced", "--devices", "cpu:2"],
    [*OWN, "--strategy", "hybrid", "--devices", "cpu:2"],  # a model with .features
])
def test_every_single_process_strategy_trains_with_both_flags(strategy, tmp_path):
    ok("train", *strategy, *FAST, "--max-steps", "2", "--out", tmp_path)
    assert (tmp_path / "checkpoint.pt").exists()


@pytest.mark.distributed
def test_two_process_ddp_trains_with_both_flags(tmp_path):
    result = run_tandem("launch", "--nproc-per-node", "2", "--", "train", *TINY,
                        "--strategy", "ddp", "--devices", "cpu", *FAST, "--max-steps", "2",
                        "--out", tmp_path, timeout=240, PYTHONWARNINGS="ignore")
    succeeded(result)
    assert (tmp_path / "checkpoint.pt").exists()


# -- tandem bench ------------------------------------------------------------------------------
SEEN = []  # the CPU autocast dtype of each Recorder forward (a global: models are copied)


class Recorder(nn.Module):
    """A tiny net that notes the CPU autocast dtype each forward runs under."""

    def __init__(self, num_classes=5):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 4, 3), nn.Linear(4, num_classes)

    def forward(self, x):
        on = torch.is_autocast_enabled("cpu")
        SEEN.append(torch.get_autocast_dtype("cpu") if on else torch.float32)
        return self.fc(self.conv(x).mean((2, 3)))


def test_bench_amp_on_the_cpu_is_bf16_without_a_scaler(monkeypatch):
    steps = []
    monkeypatch.setattr(TrainStep, "__call__", lambda self, call=TrainStep.__call__: (
        steps.append(self), call(self))[1])
    config = BenchConfig(arch="cifar_resnet20", strategies="single", devices="cpu",
                         baselines="bare", batch_size=4, steps=1, warmup=1, image_size=8,
                         num_classes=5, amp=True)
    SEEN.clear()
    report = run_bench(config, model_fn=Recorder)
    assert [r["status"] for r in report["results"]] == ["ok", "ok"]
    assert steps and all(s.scaler is None and s.amp.dtype == torch.bfloat16 for s in steps)
    assert SEEN and set(SEEN) == {torch.bfloat16}
    assert ", amp bf16;" in format_table(report)


def test_bench_variants_race_fp32_cl_amp_and_both_interleaved():
    config = BenchConfig(arch="cifar_resnet20", strategies="single,dp", devices="cpu:2",
                         baselines="bare", batch_size=4, steps=2, warmup=1, image_size=8,
                         num_classes=5, variants="fp32,cl,amp,amp+cl")
    report = run_bench(config)
    names = [r["name"] for r in report["results"]]
    assert names == [f"{n}{v}" for n in ("bare", "single", "dp")
                     for v in ("", "+cl", "+amp", "+amp+cl")]
    results = {r["name"]: r for r in report["results"]}
    for name in ("single+amp+cl", "dp+amp", "bare+cl"):
        assert results[name]["status"] == "ok", results[name]["reason"]
        assert results[name]["speedup_vs_plain"] > 0
    table = format_table(report)
    assert "variants fp32,cl,amp,amp+cl (amp: bf16)" in table
    assert "vs its fp32 eager twin: " in table


def test_bench_variants_replace_the_amp_and_channels_last_flags(capsys):
    assert main(["bench", "-a", "cifar_resnet20", "--devices", "cpu", "--variants", "amp",
                 "--amp"]) == 2
    assert "leave out --amp and --channels-last" in capsys.readouterr().err


@pytest.mark.distributed
def test_bench_variants_reach_the_torchrun_phase():
    config = BenchConfig(arch="cifar_resnet20", strategies="ddp", devices="cpu:2",
                         baselines="torch_ddp", batch_size=4, steps=1, warmup=1, image_size=8,
                         num_classes=5, variants="fp32,amp+cl")
    results = {r["name"]: r for r in run_bench(config)["results"]}
    assert list(results) == ["ddp", "ddp+amp+cl", "hybrid-ddp", "hybrid-ddp+amp+cl",
                             "torch_ddp", "torch_ddp+amp+cl"]  # hybrid-ddp joins ddp
    for name, r in results.items():
        assert r["status"] == "ok" and r["phase"] == "torchrun", (name, r["reason"])


@pytest.mark.slow
@pytest.mark.skipif(not tandem.precision.cpu_has_bf16(),
                    reason="compiling emulated bf16 kernels takes minutes on a CPU without bf16")
def test_with_compile_it_trains_and_evaluates(tmp_path, monkeypatch):
    """--compile --amp --channels-last: compiled under bf16 autocast (minutes cold, seconds
    with inductor's cache warm)."""
    import tandem.train.build

    calls = []  # forwards through the compiled module, per run

    def spy(model, mode=None):
        module = compile_model(model, mode)
        count = len(calls)
        calls.append(0)
        module.register_forward_pre_hook(lambda m, args: calls.__setitem__(count, calls[count] + 1))
        return module

    compile_model = tandem.train.build.compiled
    monkeypatch.setattr(tandem.train.build, "compiled", spy)
    ok("train", *TINY, "--devices", "cpu", *FAST, "--compile", "--max-steps", "2",
       "--out", tmp_path)
    result = ok("eval", "--resume", tmp_path / "checkpoint.pt", "--devices", "cpu",
                *FAST, "--compile", "--json")
    assert json.loads(result.stdout.strip().splitlines()[-1])["count"] > 0
    assert len(calls) == 2 and all(calls), calls  # train and eval each ran the compiled module


def test_the_force_variable_takes_a_cpu_without_bf16_as_having_it(monkeypatch):
    """The variable is read by the callers (tandem.distributed.env), never by amp_precision:
    conftest sets it, and the default still asks the CPU's flags."""
    monkeypatch.setattr(tandem.precision, "cpu_flags", lambda: frozenset({"avx2"}))
    assert not tandem.precision.cpu_has_bf16()
    with pytest.raises(UsageError, match="TANDEM_CPU_BF16=1"):
        amp_precision("cpu", True)
    assert cpu_bf16_override({}) is None and cpu_bf16_override({"TANDEM_CPU_BF16": "0"}) is None
    forced = cpu_bf16_override({"TANDEM_CPU_BF16": "1"})
    assert amp_precision("cpu", True, cpu_bf16=forced).dtype == torch.bfloat16
    assert amp_refusal("cpu", None) is not None and amp_refusal("cpu", None, cpu_bf16=forced) is None
