"""The scripts in benchmarks/: their counting logic and a tiny CPU run. Nothing is timed."""

from __future__ import annotations

import importlib.util
import json
import math
import sys

import pytest
from conftest import ROOT

BENCHMARKS = ROOT / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_script_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its functions pickle by name (make_jpegs' processes)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("replicas", [2, 4])
def test_balanced_criterion_sends_fewer_bytes_to_device0_than_gather(replicas):
    criterion_bytes = _load("criterion_bytes")
    r = criterion_bytes.measure(replicas, batch=8, classes=21, size=64)  # also checks both losses
    dp, bal = r["dataparallel"], r["balanced"]
    # DataParallel gathers the logits of replicas 1..n-1 onto replica 0 (even chunks of 8)
    gathered = r["output_bytes"] * (replicas - 1) // replicas
    assert dp["by_kind"]["gather"] == gathered
    assert dp["to_device0"] >= gathered
    # balanced sends only per-replica loss scalars there, plus the same gradient reduction
    assert "gather" not in bal["by_kind"]
    assert bal["by_kind"]["reduce"] == dp["by_kind"]["reduce"]
    assert bal["to_device0"] < dp["to_device0"]
    assert bal["to_device0"] < r["output_bytes"] // 100
    assert r["ratio_to_device0"] == dp["to_device0"] / bal["to_device0"] > 10


def test_criterion_bytes_main_writes_json(tmp_path, capsys):
    criterion_bytes = _load("criterion_bytes")
    out = tmp_path / "bytes.json"
    assert criterion_bytes.main(["--replicas", "3", "--batch", "5", "--classes", "4",
                                 "--size", "8", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["replicas"] == 3 and row["output_bytes"] == 5 * 4 * 8 * 8 * 4
    assert "DP to dev0" in capsys.readouterr().out


def test_gpu_resnet50_script_runs_tiny_on_cpu(tmp_path, capsys):
    gpu_resnet50 = _load("gpu_resnet50")
    out = tmp_path / "gpu.json"
    code = gpu_resnet50.main(["--device", "cpu", "--arch", "cifar_resnet20", "--image-size", "8",
                              "--batch-size", "2", "--steps", "2", "--warmup", "1",
                              "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["config"]["amp"] is True and report["config"]["channels_last"] is True
    assert report["reference"]["images_per_sec"] == 2470
    results = {r["name"]: r for r in report["results"]}
    assert list(results) == ["bare", "single"]
    for r in results.values():
        assert r["status"] == "ok", r["reason"]
        assert r["steps"] == 2 and math.isfinite(r["last_loss"])
    printed = capsys.readouterr().out
    assert "tandem single" in printed and "smoke test" in printed


def test_make_jpegs_writes_real_size_jpegs(tmp_path):
    from PIL import Image

    make_jpegs = _load("make_jpegs")
    assert make_jpegs.main([str(tmp_path / "j"), "--classes", "2", "--per-class", "1"]) == 0
    files = sorted((tmp_path / "j").rglob("*.jpg"))
    assert [f.parent.name for f in files] == ["class0", "class1"]
    for f in files:
        with Image.open(f) as img:
            assert (img.format, img.size, img.mode) == ("JPEG", (500, 375), "RGB")
        assert 40_000 < f.stat().st_size < 200_000  # about a photo's size at quality 90


def test_make_jpegs_writes_the_same_tree_whatever_the_processes(tmp_path):
    make_jpegs = _load("make_jpegs")
    for jobs in ("1", "2"):
        make_jpegs.main([str(tmp_path / jobs), "--classes", "2", "--per-class", "2", "--jobs",
                         jobs])
    one, two = (sorted((tmp_path / j).rglob("*.jpg")) for j in ("1", "2"))
    assert len(one) == 4 and [f.relative_to(tmp_path / "1") for f in one] == \
        [f.relative_to(tmp_path / "2") for f in two]
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(one, two))
    assert len({f.read_bytes() for f in one}) == 4  # each image its own


def test_jpeg_decoders_script_runs_every_way(tmp_path, capsys):
    pytest.importorskip("simplejpeg")
    make_jpegs, jpeg_decoders = _load("make_jpegs"), _load("jpeg_decoders")
    make_jpegs.main([str(tmp_path / "j"), "--classes", "1", "--per-class", "3"])
    out = tmp_path / "decoders.json"
    assert jpeg_decoders.main([str(tmp_path / "j"), "--image-size", "64", "--rounds", "1",
                               "--json", str(out)]) == 0
    rows = {(r["stage"], r["way"]): r for r in json.loads(out.read_text())["rows"]}
    assert {way for stage, way in rows if stage == "decode"} == set(jpeg_decoders.DECODE_WAYS)
    assert {way for stage, way in rows if stage == "resample"} == set(
        jpeg_decoders.RESAMPLE_WAYS)
    # Pillow's crops within test_decode.py's bounds (identical here), rows cut or not
    for way in ("simplejpeg", "simplejpeg rows to the box"):
        assert rows["decode", way]["crop_diff_mean"] < 0.5
        assert rows["decode", way]["crop_diff_max"] <= 8
    assert "simplejpeg" in capsys.readouterr().out


def test_keyed_dropout_script_steps_both_ways(tmp_path, capsys):
    """One round of the keyed-dropout benchmark: a step with torch's draws and one with keyed
    masks, each timed; whether the ratio meets its target is the benchmark's to say."""
    keyed = _load("keyed_dropout")
    out = tmp_path / "keyed.json"
    (row,) = keyed.main(["--models", "resnet20", "--rounds", "1", "--warmup", "0",
                         "--json", str(out)])
    assert set(row["median_s"]) == {"torch", "keyed"} and math.isfinite(row["ratio"])
    assert json.loads(out.read_text())["results"][0]["model"] == "resnet20"
    assert "resnet20" in capsys.readouterr().out


def test_large_batch_runs_each_optimizer_at_each_batch_with_commands_tandem_takes():
    """benchmarks/large_batch.py: its grid (1x once, 4x and 16x unscaled and scaled), its
    commands parsed by tandem's own train parser, and its table from rows (nothing runs)."""
    from tandem.cli.main import build_parser

    large_batch = _load("large_batch")
    runs = large_batch.grid(("sgd", "lars"), (1, 4))
    assert [(r["opt"], r["multiple"], r["scale"]) for r in runs] == [
        ("sgd", 1, "none"), ("sgd", 4, "none"), ("sgd", 4, "linear"),
        ("lars", 1, "none"), ("lars", 4, "none"), ("lars", 4, "linear")]
    parser = build_parser()
    for run in runs:
        argv = large_batch.command(run, ROOT / "runs" / "x", epochs=2, seed=0)
        assert argv[:2] == ["tandem", "train"]
        args = parser.parse_args(argv[1:])
        assert (args.optimizer, args.accum_steps, args.lr_scale) == (
            run["opt"], run["multiple"], run["scale"])
        assert args.lr_base_batch == args.batch_size == large_batch.BASE_BATCH
    rows = [dict(r, steps=10 // r["multiple"], lr=0.1 * (r["multiple"] if r["scale"] ==
                                                         "linear" else 1),
                 val_acc=90.0, diverged=r["opt"] == "lars" and r["scale"] == "linear")
            for r in runs]
    lines = large_batch.table(rows).splitlines()
    assert lines[2] == "| sgd | 32 (1x) | 10 | 0.1 | 90.00% |  |  |"
    assert lines[3] == "| sgd | 128 (4x) | 2 | 0.1 | 90.00% | 0.4 | 90.00% |"
    assert lines[5] == "| lars | 128 (4x) | 2 | 0.1 | 90.00% | 0.4 | diverged |"
