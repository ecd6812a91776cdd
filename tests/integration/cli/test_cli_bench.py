"""tandem bench's flags against BenchConfig's fields, its torchrun phase against
tandem.distributed.torchrun (spied on, never run here). Nothing is timed."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from collections import Counter

import pytest

from tandem_bench import BenchConfig
from tandem_bench.distributed import distributed_phase, worker_main
from tandem_bench.entry import Entry, lineup
from tandem.cli.common import config_from_args
from tandem.cli.main import build_parser, main
from tandem.distributed import torchrun
from tandem.errors import UsageError


# Every flag `tandem bench` had before it was derived from BenchConfig, short forms included.
_FLAGS_BEFORE = {
    "-h", "--help", "-a", "--arch", "--data", "-j", "--workers", "--strategies", "--devices",
    "-b", "--batch-size", "--steps", "--warmup", "--image-size", "--num-classes", "--amp",
    "--amp-dtype", "--channels-last", "--sync-bn", "--buffers", "--baselines", "--threads",
    "--compile", "--compile-mode", "--seed", "--dist-timeout", "--json", "--explain",
}


def _bench_parser() -> argparse.ArgumentParser:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices["bench"]


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", *argv])


def test_every_config_field_has_exactly_one_flag():
    dests = Counter(a.dest for a in _bench_parser()._actions if a.option_strings)
    for f in dataclasses.fields(BenchConfig):
        assert dests[f.name] == (1 if f.init else 0), f.name


def test_the_flags_are_the_ones_it_had_plus_the_fields_that_had_none():
    flags = {s for a in _bench_parser()._actions for s in a.option_strings}
    added_since = {"--handicap", "--variants",  # issues 22 and 24's fields, derived alike
                   "--loop", "-p", "--print-freq",
                   "--decode",  # issue 34: the fed race's decoder, tandem train's flag
                   "--link-rate", "--link-processes"}  # issue 48: the link plan's
    assert flags == _FLAGS_BEFORE | {"--lr", "--no-cudnn-benchmark"} | added_since


def test_parsing_the_defaults_gives_the_default_config():
    assert config_from_args(BenchConfig, _parse("-a", "cifar_resnet20")) == \
        BenchConfig(arch="cifar_resnet20")


def test_every_flag_reaches_its_field():
    args = _parse("-a", "resnet18", "--strategies", "single,dp", "--devices", "cpu:2", "-b", "8",
                  "--steps", "2", "--warmup", "1", "--image-size", "16", "--num-classes", "5",
                  "--amp", "--amp-dtype", "bf16", "--channels-last", "--sync-bn", "--buffers",
                  "average", "--baselines", "none", "--lr", "0.5", "--seed", "3",
                  "--dist-timeout", "10", "--no-cudnn-benchmark", "--threads", "2", "--compile",
                  "--compile-mode", "max-autotune", "--loop", "-p", "4", "--link-rate", "1gbit",
                  "--link-processes", "3")
    assert config_from_args(BenchConfig, args) == BenchConfig(
        arch="resnet18", strategies=("single", "dp"), devices="cpu:2", batch_size=8, steps=2,
        warmup=1, image_size=16, num_classes=5, amp=True, amp_dtype="bf16", channels_last=True,
        sync_bn=True, buffers="average", baselines=(), lr=0.5, seed=3, dist_timeout=10.0,
        cudnn_benchmark=False, threads=2, compile=True, compile_mode="max-autotune",
        loop=True, print_freq=4, link_rate="1gbit", link_processes=3)


def test_a_bad_choice_is_the_configs_one_line(capsys):
    assert main(["bench", "-a", "cifar_resnet20", "--devices", "cpu", "--amp-dtype", "fp8"]) == 2
    assert capsys.readouterr().err.strip() == \
        "tandem: error: bad amp dtype 'fp8': choose bf16 or fp16"


class _Stop(Exception):
    pass


@pytest.mark.parametrize("argv, passes", [
    ([], {}),  # run_loader_bench's own defaults, not the race's --steps 20 --warmup 3
    (["--steps", "20", "--warmup", "0"], {"rounds": 20, "warmup": 0}),
    (["--image-size", "16", "-j", "2"], {"image_size": 16, "workers": 2}),
])
def test_data_counts_passes_with_the_loader_benchs_defaults(monkeypatch, tmp_path, argv, passes):
    seen = {}

    def spy(data, **kwargs):
        seen.update(kwargs, data=data)
        raise _Stop

    monkeypatch.setattr("tandem_bench.cli.run_loader_bench", spy)  # where the CLI took it
    with pytest.raises(_Stop):
        main(["bench", "--data", str(tmp_path), *argv])
    assert seen == {"data": str(tmp_path), "workers": 0, "batch_size": 64, "seed": 0, **passes}


# -- the torchrun phase goes through tandem.distributed.torchrun ------------------------------

def _config(**kw) -> BenchConfig:
    return BenchConfig(arch="cifar_resnet20", strategies="single,ddp", devices="cpu:2",
                       baselines="none", dist_timeout=7, **kw)


def _spy_launcher(monkeypatch, returncode=0, stderr="", write=True, expire=False,
                  rate=1e9) -> list:
    """Replace torchrun.run_captured; it records its calls and acts as torchrun would have
    (its link measured at ``rate``)."""
    calls = []

    def run_captured(spec, timeout=None):
        calls.append((spec, timeout))
        if expire:
            raise subprocess.TimeoutExpired(torchrun.torchrun_argv(spec), timeout)
        command = spec.command
        if write:
            with open(command[command.index("--contestants") + 1]) as f:
                names = [Entry.from_json(data).name for data in json.load(f)]
            with open(command[command.index("--out") + 1], "w") as f:
                json.dump({"results": [{"name": n, "status": "ok"} for n in names],
                           "link_bytes_per_s": rate}, f)
        return subprocess.CompletedProcess(torchrun.torchrun_argv(spec), returncode, "", stderr)

    monkeypatch.setattr(torchrun, "run_captured", run_captured)
    return calls


def test_the_torchrun_phase_runs_through_launch_run_captured(monkeypatch):
    calls = _spy_launcher(monkeypatch)
    phase = distributed_phase(_config(threads=1), [Entry("ddp")])
    assert phase.results == [{"name": "ddp", "status": "ok"}] and phase.link_bytes_per_s == 1e9
    [(spec, timeout)] = calls
    assert timeout == 7 and spec.nproc_per_node == 2 and spec.max_restarts == 0
    assert spec.extra_env == {"OMP_NUM_THREADS": "1"}
    argv = torchrun.torchrun_argv(spec)
    assert argv[argv.index("-m") + 1:argv.index("-m") + 3] == ["tandem_bench.distributed",
                                                               "--config"]
    assert argv[argv.index("--rdzv-endpoint") + 1] == "127.0.0.1:0"


def test_without_threads_the_workers_split_torchs_or_keep_omp(monkeypatch):
    calls = _spy_launcher(monkeypatch)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    distributed_phase(_config(), [Entry("ddp")])
    assert calls[-1][0].extra_env == {}  # the caller's OMP_NUM_THREADS reaches the workers
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr("torch.get_num_threads", lambda: 8)
    distributed_phase(_config(), [Entry("ddp")])
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
    phase = distributed_phase(_config(), [Entry("ddp")])
    [result] = phase.results
    assert (result["status"], result["reason"], result["phase"]) == ("failed", reason,
                                                                     "torchrun")
    assert phase.link_bytes_per_s is None  # nothing measured


def test_a_worker_started_by_hand_says_how_to_launch(monkeypatch, tmp_path):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(_config().to_dict()))
    entries = tmp_path / "contestants.json"
    entries.write_text(json.dumps([Entry("ddp").to_json()]))
    with pytest.raises(UsageError, match="tandem_bench.distributed needs torchrun's environment"):
        worker_main(["--config", str(config), "--contestants", str(entries), "--out",
                     str(tmp_path / "o")])


def headless(num_classes: int = 5, in_channels: int = 3):
    """A model with no Linear head (``test_cli_bench:headless`` as --arch)."""
    from torch import nn

    return nn.Sequential(nn.Conv2d(in_channels, num_classes, 3), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten())


def test_hybrid_ddp_joins_ddp_and_a_model_without_a_head_skips_it_with_the_reason(monkeypatch):
    calls = _spy_launcher(monkeypatch)
    config = BenchConfig(arch="test_cli_bench:headless", strategies="single,ddp",
                         devices="cpu:2", baselines="none", image_size=8)
    entries = [e for e in lineup(config) if e.multiprocess]
    assert [e.name for e in entries] == ["ddp", "hybrid-ddp"]  # side by side
    ddp, hybrid = distributed_phase(config, entries).results
    assert hybrid["status"] == "skipped" and hybrid["reason"].startswith(
        "test_cli_bench:headless: hybrid-ddp needs a Linear head to split")
    assert ddp["status"] == "ok"
    [(spec, _)] = calls  # ddp alone went to the workers (the spy says ok to what it got)
    assert spec.nproc_per_node == 2
    # a model with a head: both go
    both = distributed_phase(_config(), entries).results
    assert [r["status"] for r in both] == ["ok", "ok"]


# -- --link-rate and --explain -------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--link-rate", "100mb"], "bad --link-rate '100mb': give a rate with its unit, e.g. "
                               "100mbit, 1gbit or 12.5MB/s"),
    (["--link-rate", "0mbit"], "bad --link-rate '0mbit': must be > 0 and finite"),
    (["--link-processes", "0"], "bad --link-processes 0: must be >= 1"),
])
def test_a_bad_link_option_is_one_line_naming_the_flag(capsys, argv, message):
    assert main(["bench", "-a", "cifar_resnet20", "--devices", "cpu", *argv]) == 2
    assert capsys.readouterr().err.strip() == f"tandem: error: {message}"


@pytest.mark.parametrize("processes", [None, 3])
def test_explain_with_a_link_rate_prints_the_bytes_and_their_time(capsys, tmp_path, processes):
    from tandem_bench.link import plan_link
    from tandem.models import create_model

    out = tmp_path / "bench.json"
    more = [] if processes is None else ["--link-processes", str(processes)]
    assert main(["bench", "-a", "cifar_resnet20", "--devices", "cpu:2", "--strategies",
                 "single", "--baselines", "none", "-b", "4", "--image-size", "8", "--steps",
                 "1", "--warmup", "0", "--explain", "--link-rate", "100mbit", "--json",
                 str(out), *more]) == 0
    text = capsys.readouterr().out
    w = processes or 2  # one per device by default
    # a CPU run: the link plan counts what gloo sends (its reduce-scatter is an all-reduce)
    plan = plan_link(create_model("cifar_resnet20", num_classes=10), 4, w, backend="gloo")
    assert plan.report(12.5e6) in text
    assert f"batch 4 over {w} processes" in text
    assert "link at 100 Mbit/s (--link-rate): ddp " in text
    assert "measured by an all-reduce" not in text  # no torchrun phase ran
    link = json.loads(out.read_text())["link"]
    assert link["processes"] == w and link["rates_bytes_per_s"] == {"given": 12.5e6,
                                                                    "measured": None}
    assert link["predicted_s"]["given"] == pytest.approx(
        {name: total / 12.5e6 for name, total in plan.totals().items()})
    assert link["bytes_per_step"]["ddp"]["total"] > 0


def test_without_the_harness_bench_says_so_in_one_line_and_a_hint(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tandem_bench", None)  # as if not installed
    assert main(["bench", "-a", "cifar_resnet20", "--steps", "2"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("tandem: error: tandem bench needs the benchmark harness")
    assert err[1].startswith("hint: ") and "pip install" in err[1] and len(err) == 2
