"""tandem bench: the harness's logic and the shape of its output. No test here times anything.

The subprocess test runs the real command end to end on a tiny model and checks that the JSON
is well formed with every field for every contestant; the in-process tests check interleaving,
warm-up, failure handling, statistics, config validation and the table.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys

import pytest
import torch
from torch import nn

from conftest import run_bounded, with_hooks

from tandem_bench import RESULT_FIELDS, BenchConfig, explain, format_table, run_bench, write_json
from tandem_bench.contestants import Contestant
from tandem_bench.runner import race
from tandem_bench.skips import registered_strategies
from tandem_bench.timing import MemoryProbe, resident_bytes, summarize
from tandem.cli.main import main
from tandem.data.decode import default_decoder

STEP_KEYS = {"median", "q1", "q3", "iqr", "min", "max", "mean", "n"}


def _run_cli(args, timeout=240):
    env = with_hooks(dict(os.environ, PYTHONWARNINGS="ignore"))
    return run_bounded([sys.executable, "-m", "tandem", "bench", *args], timeout, env)


def _check_result_shape(r: dict, batch: int, steps: int):
    assert list(r) == list(RESULT_FIELDS), r["name"]
    assert r["status"] in ("ok", "skipped", "failed")
    assert len(r["peak_memory_bytes"]) == len(r["devices"]) >= 1
    if r["status"] != "ok":
        assert isinstance(r["reason"], str) and r["reason"]
        assert r["step_time_s"] is None and r["images_per_sec"] is None
        return
    assert r["reason"] is None and r["steps"] == steps
    t = r["step_time_s"]
    assert set(t) == STEP_KEYS and t["n"] == steps
    assert 0 < t["min"] <= t["q1"] <= t["median"] <= t["q3"] <= t["max"]
    assert t["iqr"] == pytest.approx(t["q3"] - t["q1"])
    ips = r["images_per_sec"]
    assert ips["median"] == pytest.approx(batch / t["median"])
    assert ips["q1"] <= ips["median"] <= ips["q3"]
    assert r["speedup_vs_bare"] is None or r["speedup_vs_bare"] > 0
    assert math.isfinite(r["last_loss"])
    assert isinstance(r["notes"], list)


def test_the_strategies_raced_here_are_registered():
    """The tests below name these strategies and expect results from them: a strategy that
    drops out of the registry fails here (and there), rather than turning them into skips."""
    assert {"single", "dp", "balanced", "hybrid", "ddp"} <= set(registered_strategies())


def test_the_default_strategies_come_from_the_registrys_abilities(monkeypatch):
    """`tandem bench` without --strategies races every single-process strategy that takes any
    model, asked of the registry: a new one joins the default, a multi-process one or one
    with model needs (hybrid's split) does not."""
    from tandem_bench.options import default_strategies
    from tandem.cli.main import build_parser
    from tandem.strategies import Strategy, base

    assert build_parser().parse_args(["bench", "-a", "cifar_resnet20"]).strategies is None
    assert BenchConfig(arch="cifar_resnet20").strategies == default_strategies() == (
        "single", "dp", "balanced")
    registry = dict(base._REGISTRY)
    monkeypatch.setattr(base, "_REGISTRY", registry)
    for name, abilities in (("fresh", {}), ("fresh_mp", {"multiprocess": True}),
                            ("fresh_split", {"check_model": classmethod(lambda cls, m: "no")})):
        base.register(type(name, (Strategy,), {"name": name, **abilities}))
    assert default_strategies() == ("single", "dp", "balanced", "fresh")


def test_cli_bench_json_every_field(tmp_path):
    out = tmp_path / "bench.json"
    proc = _run_cli(["--arch", "cifar_resnet20", "--strategies", "single,dp,balanced,hybrid",
                     "--devices", "cpu:2", "--baselines", "bare,torch_dp", "--batch-size", "4",
                     "--steps", "2", "--warmup", "1", "--image-size", "16", "--json", str(out)])
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert set(report) == {"config", "machine", "results", "link"}
    config = report["config"]
    assert config["arch"] == "cifar_resnet20" and config["batch_size"] == 4
    assert config["device_list"] == ["cpu", "cpu"] and config["num_classes"] == 10
    for key in ("date_utc", "torch", "cpu_count", "torch_threads", "accelerators"):
        assert key in report["machine"]

    results = {r["name"]: r for r in report["results"]}
    assert list(results) == ["bare", "single", "dp", "balanced", "hybrid", "torch_dp"]
    for r in results.values():
        _check_result_shape(r, batch=4, steps=2)
        assert r["peak_memory_bytes"] == [None] * len(r["devices"])  # the CPU reports none
        if r["status"] == "ok":
            assert r["speedup_vs_bare"] > 0 and r["speedup_vs_single"] > 0
    for name in ("bare", "single", "dp", "balanced"):
        assert results[name]["status"] == "ok", results[name]["reason"]
    assert results["single"]["devices"] == ["cpu"]
    assert results["single"]["speedup_vs_single"] == 1.0
    assert results["single"]["bytes_per_step"]["total"] == 0
    assert results["bare"]["bytes_per_step"] is None  # plain torch: nothing counted
    for name in ("dp", "balanced"):
        if results[name]["status"] == "ok":
            assert results[name]["devices"] == ["cpu", "cpu"]
            traffic = results[name]["bytes_per_step"]
            assert traffic["total"] > 0 and traffic["total"] == sum(traffic["by_kind"].values())
    assert results["hybrid"]["status"] == "ok", results["hybrid"]["reason"]  # splits .fc
    assert "CUDA" in results["torch_dp"]["reason"]
    # the table went to stdout and names every contestant
    for name in results:
        assert name in proc.stdout


@pytest.mark.slow
@pytest.mark.distributed
def test_cli_bench_ddp_and_torch_ddp_run_under_torchrun_on_cpu(tmp_path):
    out = tmp_path / "ddp.json"
    proc = _run_cli(["--arch", "cifar_resnet20", "--strategies", "single,ddp", "--devices",
                     "cpu:2", "--baselines", "torch_ddp", "--batch-size", "4", "--steps", "1",
                     "--warmup", "0", "--image-size", "8", "--dist-timeout", "200",
                     "--threads", "1", "--json", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    results = {r["name"]: r for r in report["results"]}
    ddp = results["ddp"]
    _check_result_shape(ddp, batch=4, steps=1)
    assert ddp["status"] == "ok", ddp["reason"]
    assert ddp["phase"] == "torchrun" and ddp["devices"] == ["cpu", "cpu"]
    assert ddp["bytes_per_step"]["uncounted"] == ("torch DDP's gradient all-reduce and buffer "
                                                  "broadcast")  # BatchNorm's, --buffers replica0
    assert ddp["notes"] == ["torchrun phase: 2 processes, 1 torch threads each"]
    # the hybrid across processes beside it: its trunk's gradients counted by its comm hook,
    # the head's activations by its collectives, each as this process sends them
    hybrid = results["hybrid-ddp"]
    _check_result_shape(hybrid, batch=4, steps=1)
    assert hybrid["status"] == "ok", hybrid["reason"]
    assert hybrid["phase"] == "torchrun" and hybrid["notes"] == ddp["notes"]
    traffic = hybrid["bytes_per_step"]
    assert traffic["uncounted"] == "torch DDP's buffer broadcast"
    planned = report["link"]["bytes_per_step"]["hybrid-ddp"]["by_kind"]
    # the plan's, to a byte, but for the buffers torch broadcasts (planned, not counted)
    assert traffic["by_kind"] == {k: v for k, v in planned.items() if k != "buffers"}
    assert planned["buffers"] > 0
    assert traffic["by_kind"]["gradients"] > 0 and traffic["by_kind"]["activations"] > 0
    assert report["link"]["rates_bytes_per_s"]["measured"] > 0  # the phase's all-reduce
    # torch's own DDP (gloo, plain BatchNorm) ran beside it on the CPU, in the same phase
    peer = results["torch_ddp"]
    _check_result_shape(peer, batch=4, steps=1)
    assert peer["status"] == "ok", peer["reason"]
    assert peer["phase"] == "torchrun" and peer["devices"] == ["cpu", "cpu"]
    assert peer["bytes_per_step"] is None and peer["notes"] == ddp["notes"]


def test_torch_ddp_with_sync_bn_on_cpu_says_why_it_cannot_run():
    from tandem_bench.distributed import distributed_phase
    from tandem_bench.entry import Entry

    config = BenchConfig(arch="cifar_resnet20", strategies="single", devices="cpu:2",
                         baselines="torch_ddp", sync_bn=True)
    [result] = distributed_phase(config, [Entry("torch_ddp", "baseline")]).results  # no torchrun
    assert result["status"] == "skipped"
    assert result["reason"] == "--sync-bn needs CUDA here (torch's nn.SyncBatchNorm is CUDA-only)"


def test_cli_user_mistakes_are_one_line(capsys):
    assert main(["bench", "--arch", "no_such_model"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tandem: error: unknown model 'no_such_model'") and "\n" not in err
    assert main(["bench", "--arch", "cifar_resnet20", "--strategies", "single,warp"]) == 2
    assert "unknown name 'warp' in --strategies" in capsys.readouterr().err
    assert main(["bench", "--arch", "cifar_resnet20", "--devices", "gpu:9"]) == 2
    assert "bad --devices" in capsys.readouterr().err


@pytest.mark.parametrize("kwargs, message", [
    (dict(strategies="single,single"), "listed twice"),
    (dict(strategies=""), "at least one"),
    (dict(steps=0), "steps"),
    (dict(warmup=-1), "warmup"),
    (dict(baselines="bare,torch_fsdp"), "torch_fsdp"),
    (dict(amp_dtype="fp8"), "amp dtype"),
    (dict(amp=True, amp_dtype="fp16"), "fp16 is for CUDA"),  # --amp on the CPU is bf16
    (dict(variants="fp32,fp8"), "fp8"),
    (dict(variants="amp", channels_last=True), "leave out amp and channels_last"),
    (dict(threads=0), "threads"),
    (dict(compile_mode="max-autotune"), "compile_mode needs compile"),
    (dict(compile=True, compile_mode="fast"), "bad compile mode"),
    (dict(compile=True, warmup=0), "the first step compiles"),
])
def test_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BenchConfig(arch="cifar_resnet20", devices="cpu", **kwargs)


def test_config_defaults_follow_the_model():
    small = BenchConfig(arch="cifar_resnet20", devices="cpu", baselines="none")
    assert (small.image_size, small.num_classes, small.baselines) == (32, 10, ())
    big = BenchConfig(arch="resnet50", devices="cpu:3")
    assert (big.image_size, big.num_classes) == (224, 1000)
    assert big.device_list == [torch.device("cpu")] * 3
    assert BenchConfig.from_dict(big.to_dict()) == big


def test_summarize_quartiles():
    s = summarize([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s.median, s.q1, s.q3, s.iqr, s.min, s.max, s.mean, s.n) == (3, 2, 4, 2, 1, 5, 3, 5)
    one = summarize([0.5])
    assert (one.median, one.iqr, one.min, one.max) == (0.5, 0, 0.5, 0.5)
    with pytest.raises(ValueError):
        summarize([])


def _fake(name, log, fail_on=None):
    calls = {"n": 0}

    def step():
        calls["n"] += 1
        log.append(name)
        if calls["n"] == fail_on:
            raise RuntimeError(f"{name} broke\nsecond line")
        return torch.tensor(1.5)

    return Contestant(name=name, kind="strategy", devices=[torch.device("cpu")], step=step)


def test_race_warms_up_then_interleaves_with_rotation():
    log: list[str] = []
    contestants = [_fake(n, log) for n in "abc"]
    results = race(contestants, steps=3, warmup=1, batch_size=8)
    # round r starts with contestant r mod 3; round 0 is the untimed warm-up
    assert log == list("abc" "bca" "cab" "abc")
    for r in results:
        assert r["status"] == "ok" and r["steps"] == 3 and r["step_time_s"]["n"] == 3
        assert r["last_loss"] == 1.5 and r["bytes_per_step"] is None  # counts_traffic False


def test_race_reports_failures_and_skips_without_stopping_the_others():
    log: list[str] = []
    contestants = [_fake("a", log), _fake("b", log, fail_on=2),
                   Contestant(name="c", kind="baseline", devices=[torch.device("cpu")] * 2,
                              skipped="needs CUDA (>=2 GPUs)")]
    results = {r["name"]: r for r in race(contestants, steps=4, warmup=0, batch_size=2)}
    assert results["a"]["status"] == "ok" and results["a"]["steps"] == 4
    assert results["b"]["status"] == "failed"
    assert results["b"]["reason"] == "RuntimeError: b broke"  # first line only
    assert log.count("b") == 2  # it left the race when it broke
    assert results["c"]["status"] == "skipped" and results["c"]["reason"].startswith("needs CUDA")
    assert results["c"]["peak_memory_bytes"] == [None, None]
    for r in results.values():
        assert list(r) == list(RESULT_FIELDS)
    with pytest.raises(RuntimeError, match="b broke"):
        race([_fake("b", [], fail_on=1)], steps=1, warmup=0, batch_size=1, catch=False)


def test_resident_bytes_counts_shared_storage_once():
    a = torch.zeros(10)
    view = a[2:5]
    b = torch.zeros(3, dtype=torch.float64)
    assert resident_bytes([a, view, b, None]) == {torch.device("cpu"): 40 + 24}
    probe = MemoryProbe([torch.device("cpu")] * 2)
    assert not probe.active
    assert probe.prime(lambda: "first", [a]) == "first"
    probe.start()
    probe.stop()
    assert probe.per_device() == [None, None]  # the CPU has no allocator statistics


class FakeAllocator:
    """Allocator statistics of one imaginary device, driven by the test."""

    def __init__(self, allocated):
        self.allocated = self.peak = allocated

    def alloc(self, n):
        self.allocated += n
        self.peak = max(self.peak, self.allocated)

    def memory_allocated(self, device):
        return self.allocated

    def max_memory_allocated(self, device):
        return self.peak

    def reset_peak_memory_stats(self, device):
        self.peak = self.allocated


def test_memory_probe_nets_out_the_other_contestants():
    fake = FakeAllocator(allocated=1000)  # other contestants' models already hold 1000 bytes
    device = torch.device("cpu")
    probe = MemoryProbe([device], backend_for=lambda d: fake)
    assert probe.active
    weights = torch.zeros(25)  # 100 bytes this contestant holds before its first step

    def first_step():  # leaves 60 bytes resident (grads, optimizer state), peaks 300 above
        fake.alloc(300)
        fake.alloc(-240)

    probe.prime(first_step, [weights])
    for working in (500, 700, 400):  # timed steps: transient working memory, freed after
        probe.start()
        fake.alloc(working)
        fake.alloc(-working)
        probe.stop()
    # alone, it would peak at its resident 100 + 60 plus its largest working set 700
    assert probe.per_device() == [100 + 60 + 700]


class TinySplitNet(nn.Module):
    """A model with the .features/.classifier split that hybrid and --explain need."""

    def __init__(self, num_classes=5):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(2), nn.Flatten())
        self.classifier = nn.Sequential(nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, num_classes))

    def forward(self, x):
        return self.classifier(self.features(x))


@pytest.mark.parametrize("amp_dtype", ["bf16", None])  # None: the CPU's, bf16
def test_run_bench_amp_channels_last_in_process(amp_dtype):
    config = BenchConfig(arch="cifar_resnet20", strategies="single,ddp", devices="cpu",
                         baselines="bare,torch_dp,torch_ddp", batch_size=2, steps=1, warmup=1,
                         image_size=8, num_classes=5, amp=True, amp_dtype=amp_dtype,
                         channels_last=True)
    report = run_bench(config, model_fn=lambda: TinySplitNet(5))
    results = {r["name"]: r for r in report["results"]}
    assert results["bare"]["status"] == results["single"]["status"] == "ok"
    assert "custom model" in results["torch_ddp"]["reason"]
    assert "custom model" in results["ddp"]["reason"]  # cannot go to torchrun workers
    assert math.isfinite(results["single"]["last_loss"])
    assert "amp bf16, channels_last" in format_table(report)


def test_run_bench_hybrid_on_a_split_model():
    config = BenchConfig(arch="alexnet", strategies="single,dp,hybrid", devices="cpu:2",
                         baselines="bare", batch_size=3, steps=1, warmup=0, image_size=8,
                         num_classes=5)
    results = {r["name"]: r for r in run_bench(config, model_fn=lambda: TinySplitNet(5))["results"]}
    assert results["hybrid"]["status"] == "ok", results["hybrid"]["reason"]
    assert results["hybrid"]["bytes_per_step"]["total"] > 0


def test_table_and_json_output(capsys):
    config = BenchConfig(arch="cifar_resnet20", strategies="single", devices="cpu",
                         baselines="bare,torch_dp", batch_size=2, steps=1, warmup=0,
                         image_size=8, num_classes=5)
    report = run_bench(config, model_fn=lambda: TinySplitNet(5))
    table = format_table(report)
    assert "torch_dp *  skipped: needs CUDA (>=2 GPUs)" in table
    assert "n/a" in table and "not counted" in table
    write_json(report, "-")
    assert json.loads(capsys.readouterr().out)["config"]["arch"] == "cifar_resnet20"


def test_rows_whose_iqr_is_over_half_the_median_are_marked_noise():
    """Fabricated step times: a quiet row and one under load (IQR 2.1 s, median 1.1 s)."""
    config = BenchConfig(arch="cifar_resnet20", strategies="single,dp", devices="cpu:2",
                         baselines="bare", batch_size=2, steps=1, warmup=0, image_size=8,
                         num_classes=5)
    report = run_bench(config, model_fn=lambda: TinySplitNet(5))
    times = {"bare": [1.0, 1.01, 0.99, 1.02, 1.0], "single": [1.0, 1.1, 0.95, 1.05, 1.0],
             "dp": [0.3, 1.1, 4.0, 0.4, 2.6, 1.0, 3.5]}
    for r in report["results"]:
        r["step_time_s"] = summarize(times[r["name"]]).as_dict()
    twin = dict(report["results"][1], name="single/loop", loop_over_step=0.568,
                step_time_s=summarize(times["dp"]).as_dict())  # a loop "faster" than its step
    report["results"].append(twin)
    lines = format_table(report).splitlines()
    assert "  single/loop: 1100.0 (2350.0) vs 1000.0 (50.0): 0.568x (noise) ?" in lines
    rows = {line.split()[0]: line for line in lines[2:5]}
    assert rows["dp"].startswith("dp !") and " !" not in rows["single"] + rows["bare"]
    [note] = [line for line in lines if line.startswith("! noise: ")]
    assert note.startswith("! noise: dp, single/loop spread more than 50% of the median")
    for r in report["results"]:
        r["step_time_s"] = summarize(times["bare"]).as_dict()
    assert "!" not in format_table(report)


def _quiet(report, name="single", ratio=0.885):
    """``report`` with quiet fabricated step times and a loop twin of ``name`` whose
    loop/step ratio is ``ratio``."""
    for r in report["results"]:
        r["step_time_s"] = summarize([1.0, 1.01, 0.99, 1.02, 1.0]).as_dict()
    step = next(r for r in report["results"] if r["name"] == name)
    report["results"].append(dict(step, name=name + "/loop", loop_over_step=ratio))
    return report


def test_a_loop_faster_than_its_own_step_is_marked_as_a_ratio_that_cannot_be_true():
    config = BenchConfig(arch="cifar_resnet20", strategies="single", devices="cpu",
                         baselines="none", batch_size=2, steps=1, warmup=0, image_size=8,
                         num_classes=5)
    report = _quiet(run_bench(config, model_fn=lambda: TinySplitNet(5)), ratio=0.885)
    lines = format_table(report).splitlines()
    assert "  single/loop: 1000.0 (10.0) vs 1000.0 (10.0): 0.885x ?" in lines, lines
    [note] = [line for line in lines if line.startswith("? cannot be true: ")]
    assert "single/loop 0.885x its own step" in note and "noise" in note
    report["results"][-1]["loop_over_step"] = 1.02  # slower than its step: possible
    assert "cannot be true" not in format_table(report)


def test_a_fed_loop_faster_than_its_bare_step_is_marked_as_a_ratio_that_cannot_be_true():
    from tandem_bench.fed import format_fed_table

    def row(name, rate):
        return {"name": name, "images": 64, "images_per_sec": summarize([rate] * 3).as_dict(),
                "startup_seconds": None, "data_share": None, "cpu_ms_per_image": None}

    report = {"config": {"data": "d", "arch": "a", "image_size": 8, "batch_size": 4,
                         "workers": 1, "decode": "cpu", "device": "cpu", "torch_threads": 1,
                         "rounds": 3, "warmup": 1},
              "machine": {"torch": "t", "cpu_count": 2, "date_utc": "now"},
              "results": [row("loader", 300.0), row("step", 100.0), row("fed", 113.0)],
              "limit": "step", "ratio": 1.13, "fed_vs_loader": 0.38, "fed_vs_step": 1.13}
    lines = format_fed_table(report).splitlines()
    assert "fed / step 1.13x ?" in lines[-2], lines
    assert lines[-1].startswith("? cannot be true: fed 1.13x its own step")
    report.update(ratio=0.9, fed_vs_step=0.9)
    assert "cannot be true" not in format_fed_table(report)


@pytest.mark.parametrize("baselines, footer", [("none", False), ("bare", True)])
def test_the_baseline_footer_only_under_a_table_with_a_baseline(baselines, footer):
    config = BenchConfig(arch="cifar_resnet20", strategies="single", devices="cpu",
                         baselines=baselines, batch_size=2, steps=1, warmup=0, image_size=8,
                         num_classes=5)
    table = format_table(run_bench(config, model_fn=lambda: TinySplitNet(5)))
    assert ("* baseline in plain torch" in table) == footer
    assert "Ratios are median step times" in table


def test_loader_rows_whose_iqr_is_over_half_the_median_are_marked_noise():
    from tandem_bench.loader_bench import format_loader_table

    def row(name, rates):
        return {"name": name, "decoder": "pil", "images": 64,
                "images_per_sec": summarize(rates).as_dict(), "images_per_sec_per_core": 1.0,
                "images_per_cpu_sec": None, "ratio_vs_reference": 1.0,
                "cpu_ratio_vs_reference": None}

    report = {"config": {"data": "d", "image_size": 8, "batch_size": 4, "workers": 0,
                         "rounds": 5, "warmup": 1},
              "machine": {"torch": "t", "cpu_count": 2, "date_utc": "now"},
              "results": [row("reference", [100, 101, 99, 102, 100]),
                          row("loader", [20, 300, 90, 250, 40])],
              "ratio_loader_vs_reference": 1.0, "cpu_ratio_loader_vs_reference": None}
    lines = format_loader_table(report).splitlines()
    assert lines[3].startswith("loader !") and "!" not in lines[2]
    assert lines[-1].startswith("! noise: loader spread more than 50%")


@pytest.mark.skipif(not shutil.which("g++") and not shutil.which("clang++"),
                    reason="torch.compile on the CPU needs a C++ compiler")
@pytest.mark.timeout(900)
def test_compile_races_a_twin_of_every_contestant(capsys):
    config = BenchConfig(arch="cifar_resnet20", strategies="single,dp", devices="cpu:2",
                         baselines="bare,torch_dp", batch_size=4, steps=2, warmup=1,
                         image_size=8, num_classes=5, compile=True)
    report = run_bench(config, model_fn=lambda: TinySplitNet(5))
    results = {r["name"]: r for r in report["results"]}
    assert list(results) == ["bare", "bare+compile", "single", "single+compile", "dp",
                             "dp+compile", "torch_dp", "torch_dp+compile"]
    for name in ("bare", "single", "dp"):
        for twin in (name, name + "+compile"):
            _check_result_shape(results[twin], batch=4, steps=2)
    for name in ("bare", "single"):
        twin = results[name + "+compile"]
        assert twin["status"] == "ok", twin["reason"]
        assert twin["first_step_s"] > 0 and twin["speedup_vs_eager"] > 0
        assert twin["notes"] == results[name]["notes"]  # raced in the same rounds
        assert twin["last_loss"] == pytest.approx(results[name]["last_loss"], rel=1e-3)
    assert results["single"]["speedup_vs_eager"] is None
    assert results["dp+compile"]["status"] == "skipped"
    assert results["dp+compile"]["reason"].startswith("--compile does not work with --strategy dp")
    assert "CUDA" in results["torch_dp+compile"]["reason"]
    table = format_table(report)
    assert "single+compile" in table and "compile (first, untimed step" in table
    assert report["config"]["compile"] is True


def _stepped_model(contestant: Contestant) -> nn.Module:
    """The module a baseline's step calls: the one with parameters in its step's closure."""
    cells = [c.cell_contents for c in contestant.step.forward_loss.__closure__]
    return next(m for m in cells if isinstance(m, nn.Module) and list(m.parameters()))


@pytest.mark.distributed
def test_compiled_baselines_save_the_plain_models_keys(tmp_path):
    """The torch baselines' ``+compile`` twins go through tandem's one ``compiled``, so their
    state dicts have no ``_orig_mod.``. Building a contestant compiles nothing yet."""
    from datetime import timedelta

    import torch.distributed as dist

    from tandem_bench.baselines import bare_contestant, torch_ddp_contestant
    from tandem.precision import amp_precision

    plain = list(TinySplitNet(5).state_dict())
    batch = (torch.randn(2, 3, 8, 8), torch.tensor([0, 1]))
    bare = bare_contestant(TinySplitNet(5), [torch.device("cpu")], batch, amp=amp_precision("cpu", False), lr=0.1,
                           compiled=True)
    model = _stepped_model(bare)
    assert isinstance(model, torch._dynamo.eval_frame.OptimizedModule)
    assert list(model.state_dict()) == plain
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1, timeout=timedelta(seconds=60))
    try:
        ddp = torch_ddp_contestant(TinySplitNet(5), torch.device("cpu"), batch, amp=amp_precision("cpu", False),
                                   lr=0.1, compiled=True)
        try:
            inner = _stepped_model(ddp).module
            assert isinstance(inner, torch._dynamo.eval_frame.OptimizedModule)
            assert list(inner.state_dict()) == plain
        finally:
            ddp.close()
    finally:
        dist.destroy_process_group()


def test_explain_prints_the_hybrid_plan_or_says_why_not():
    text = explain(TinySplitNet(5), ["cpu", "cpu"], batch_size=8, image_size=8)
    assert text.startswith("hybrid plan:")
    headless = explain(nn.Linear(2, 2), ["cpu"], 8, 8)
    assert headless.startswith("--explain: Linear: hybrid does not apply (")
    assert "--hybrid-head" in headless  # the CLI's words for the option that names a head
    from tandem.models import create_model  # a ResNet's .fc is a head too
    assert explain(create_model("resnet18", num_classes=10), ["cpu", "cpu"], 8, 64).startswith(
        "hybrid plan: ResNet")


def _cuda_devices_flag() -> str:
    return "cuda:0,1" if torch.cuda.device_count() >= 2 else "cuda:0"


@pytest.mark.cuda
def test_run_bench_on_cuda_reports_peak_memory():
    config = BenchConfig(arch="cifar_resnet20", strategies="single,dp,balanced",
                         devices=_cuda_devices_flag(), baselines="bare,torch_dp", batch_size=8,
                         steps=2, warmup=1, amp=True, channels_last=True)
    results = {r["name"]: r for r in run_bench(config)["results"]}
    for name in ("bare", "single", "dp", "balanced"):
        r = results[name]
        assert r["status"] == "ok", r["reason"]
        assert all(isinstance(m, int) and m > 0 for m in r["peak_memory_bytes"]), name
    multi = torch.cuda.device_count() >= 2
    assert results["torch_dp"]["status"] == ("ok" if multi else "skipped")


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.distributed
def test_cli_bench_ddp_and_torch_ddp_on_cuda(tmp_path):
    out = tmp_path / "ddp.json"
    proc = _run_cli(["--arch", "cifar_resnet20", "--strategies", "single,ddp", "--devices",
                     _cuda_devices_flag(), "--baselines", "torch_ddp", "--batch-size", "8",
                     "--steps", "2", "--warmup", "1", "--json", str(out)], timeout=400)
    assert proc.returncode == 0, proc.stderr
    results = {r["name"]: r for r in json.loads(out.read_text())["results"]}
    for name in ("ddp", "torch_ddp"):
        r = results[name]
        _check_result_shape(r, batch=8, steps=2)
        assert r["status"] == "ok" and r["phase"] == "torchrun", r["reason"]
        assert all(isinstance(m, int) and m > 0 for m in r["peak_memory_bytes"])


def test_a_broken_setup_is_reported_as_failed_and_the_cli_exits_1(monkeypatch, capsys):
    from tandem_bench import suite

    broken = suite._build("dp", "strategy", [torch.device("cpu")], lambda: 1 / 0)
    (result,) = race([broken], steps=1, warmup=0, batch_size=2)
    assert result["status"] == "failed"
    assert result["reason"] == "setup: ZeroDivisionError: division by zero"

    def fake_run_bench(config):
        report = run_bench(config, model_fn=lambda: TinySplitNet(5))
        report["results"].append(result)
        return report

    monkeypatch.setattr("tandem_bench.cli.run_bench", fake_run_bench)  # where the CLI took it
    code = main(["bench", "--arch", "cifar_resnet20", "--strategies", "single", "--devices",
                 "cpu", "--baselines", "none", "--batch-size", "2", "--steps", "1",
                 "--warmup", "0", "--image-size", "8", "--num-classes", "5"])
    assert code == 1
    assert "dp          failed: setup: ZeroDivisionError" in capsys.readouterr().out


# -- tandem bench --data: the input pipeline alone ------------------------------------------

def _jpeg_tree(root, n=6):
    from PIL import Image

    rng = torch.Generator().manual_seed(0)
    for i in range(n):
        path = root / f"c{i % 2}" / f"{i}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        pixels = torch.randint(0, 256, (36, 48, 3), generator=rng, dtype=torch.uint8)
        Image.fromarray(pixels.numpy()).save(path, quality=90)
    return root


@pytest.mark.parametrize("workers", [0, 1])
def test_bench_data_json_has_loader_and_reference(tmp_path, workers, capsys):
    out = tmp_path / "loader.json"
    code = main(["bench", "--data", str(_jpeg_tree(tmp_path / "jpegs")), "--image-size", "16",
                 "-j", str(workers), "-b", "2", "--steps", "2", "--warmup", "0",
                 "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    results = {r["name"]: r for r in report["results"]}
    pillow_too = ["loader-pillow"] if default_decoder() != "pillow" else []
    assert list(results) == ["loader", *pillow_too, "reference"]
    assert results["loader"]["decoder"] == default_decoder()
    for r in results.values():
        assert r["images_per_sec"]["median"] > 0 and r["images_per_sec"]["n"] == 2
        assert r["images"] == 4  # the training split of the 80/20 split
        assert "images_per_cpu_sec" in r  # None off Linux or for passes under a clock tick
    assert (results["loader"]["batch_dtype"], results["reference"]["batch_dtype"]) == \
        ("uint8", "float32")
    assert report["config"]["workers"] == workers and report["ratio_loader_vs_reference"] > 0
    assert report["ratio_loader_vs_reference"] == results["loader"]["ratio_vs_reference"]
    assert "loader / reference" in capsys.readouterr().out


def test_bench_data_errors_are_one_line(tmp_path, capsys):
    assert main(["bench", "--data", str(tmp_path / "missing")]) == 2
    assert main(["bench", "--data", str(tmp_path), "--arch", "cifar_resnet20",
                 "--variants", "fp32,cl"]) == 2
    assert main(["bench", "--data", str(tmp_path), "--arch", "cifar_resnet20"]) == 2
    assert main(["bench"]) == 2
    err = capsys.readouterr().err
    assert "missing" in err and "leave out --variants" in err and "needs --arch" in err
    assert f"'{tmp_path}'" in err
    assert "Traceback" not in err


# -- a contestant is a value: its name, its JSON, the threads it leaves behind ---------------
def test_an_entry_renders_todays_names_and_survives_json():
    from tandem_bench.entry import Entry, lineup
    from tandem_bench.variants import Variant

    cl, amp_cl = Variant.named("cl"), Variant.named("amp+cl")
    cases = {
        "single": Entry("single"),
        "bare+compile": Entry("bare", "baseline", compiled=True),
        "torch_dp+cl": Entry("torch_dp", "baseline", variant=cl),
        "torch_ddp+amp+cl+compile": Entry("torch_ddp", "baseline", variant=amp_cl,
                                          compiled=True),
        "dp/auto": Entry("dp", split="auto", handicap=(1, 3.0)),
        "dp/ideal+amp+cl": Entry("dp", split=(1.0, 1 / 3), variant=amp_cl, handicap=(1, 3.0)),
        "ddp+compile/loop": Entry("ddp", compiled=True, loop=True),
        "balanced/ideal+cl+compile/loop": Entry("balanced", split=(0.5, 1.0), variant=cl,
                                                compiled=True, loop=True, handicap=(0, 2.0)),
    }
    for name, entry in cases.items():
        assert entry.name == name
        data = json.loads(json.dumps(entry.to_json()))
        assert Entry.from_json(data) == entry and Entry.from_json(data).name == name
    config = BenchConfig(arch="cifar_resnet20", strategies="single,dp,ddp", devices="cpu:2",
                         handicap="1:3", variants="fp32,cl", compile=True, loop=True)
    entries = lineup(config)
    names = [e.name for e in entries]
    assert names[:4] == ["bare", "bare+compile", "bare+cl", "bare+cl+compile"]
    assert names[4:8] == ["single", "single/loop", "single+compile", "single+compile/loop"]
    assert "dp/ideal+cl+compile/loop" in names and "ddp/auto+cl/loop" in names
    assert names[-4:] == ["torch_ddp", "torch_ddp+compile", "torch_ddp+cl",
                          "torch_ddp+cl+compile"]
    assert len(names) == len(set(names)) == 4 + 8 + 3 * 8 + 3 * 8 + 8 + 4 + 4
    assert names[names.index("ddp/ideal+cl+compile/loop") + 1] == "hybrid-ddp"  # it joins ddp
    assert "hybrid-ddp/auto" not in names  # it splits the batch evenly only
    assert [e.name for e in entries if e.multiprocess] == [
        n for n in names if n.startswith(("ddp", "hybrid-ddp", "torch_ddp"))]
    ideal = next(e for e in entries if e.name == "dp/ideal")
    assert ideal.split == config.ideal_split() and ideal.handicap == (1, 3.0)
    assert all(Entry.from_json(json.loads(json.dumps(e.to_json()))) == e for e in entries)


@pytest.mark.parametrize("fails", [False, True])
def test_run_bench_gives_torch_its_threads_back(monkeypatch, fails):
    from tandem_bench import suite

    if fails:
        def broken_race(*args, **kwargs):
            raise RuntimeError("boom")

        monkeypatch.setattr(suite, "race", broken_race)
    config = BenchConfig(arch="cifar_resnet20", strategies="single", devices="cpu",
                         baselines="none", batch_size=2, steps=1, warmup=0, image_size=8,
                         num_classes=5, threads=1)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        if fails:
            with pytest.raises(RuntimeError, match="boom"):
                run_bench(config, model_fn=lambda: TinySplitNet(5))
        else:
            report = run_bench(config, model_fn=lambda: TinySplitNet(5))
            assert report["machine"]["torch_threads"] == 1  # the race ran on config's threads
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
