"""`tandem bench --data DIR -a ARCH` (issue 34, item 2), small: the loader, step and fed rows
and the fed / min(loader, step) ratio, checked against the report's own rates (no speed is
asserted: this is the benchmark's plumbing, BENCHMARKS.md holds its figures)."""

import json

import pytest
from conftest import make_image_folder, run_in_process

pytestmark = pytest.mark.slow


def test_fed_races_loader_and_step_and_reports_the_ratio(tmp_path):
    data = make_image_folder(tmp_path / "jpegs", per_class=5, size=40)
    out = tmp_path / "fed.json"
    result = run_in_process("bench", "--data", data, "-a", "cifar_resnet20", "--image-size",
                            "16", "-b", "4", "-j", "1", "--steps", "1", "--warmup", "0",
                            "--json", out)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    rows = {r["name"]: r for r in report["results"]}
    assert list(rows) == ["loader", "step", "fed"]
    rate = {name: r["images_per_sec"]["median"] for name, r in rows.items()}
    assert all(r > 0 and rows[n]["images_per_sec"]["n"] == 1 for n, r in rate.items())
    assert rows["step"]["startup_seconds"] is None
    assert rows["loader"]["startup_seconds"] >= 0 and rows["fed"]["startup_seconds"] >= 0
    assert rows["fed"]["images"] == 12  # the training split of the 80/20 split
    assert 0 <= rows["fed"]["data_share"] <= 1  # the loop's own data wait, as train shows it
    assert rows["loader"]["data_share"] is None and rows["step"]["data_share"] is None
    assert all(r["cpu_ms_per_image"] is None or r["cpu_ms_per_image"] >= 0
               for r in rows.values())
    limit = min(("loader", "step"), key=rate.get)
    assert report["limit"] == limit
    assert report["ratio"] == pytest.approx(rate["fed"] / rate[limit])
    assert report["fed_vs_loader"] == pytest.approx(rate["fed"] / rate["loader"])
    assert report["fed_vs_step"] == pytest.approx(rate["fed"] / rate["step"])
    config = report["config"]
    assert (config["workers"], config["batch_size"], config["image_size"]) == (1, 4, 16)
    table = result.stdout
    assert f"fed / min(loader, step): {report['ratio']:.2f}x (the {limit} is the limit" in table
    for name in rows:
        assert any(line.startswith(name + " ") for line in table.splitlines()), name
