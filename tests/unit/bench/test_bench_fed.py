"""`tandem bench --data DIR -a ARCH` (issue 34, item 2), small: the loader, step and fed rows
and the fed / min(loader, step) ratio, checked against the report's own rates (no speed is
asserted: this is the benchmark's plumbing, BENCHMARKS.md holds its figures)."""

import json

import pytest
from conftest import make_image_folder, run_in_process

from tandem_bench import fed
from tandem.data.device_decode import DeviceDecoded, host_decode

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
    assert config["decode"] == "cpu"  # --decode auto on the CPU
    table = result.stdout
    mark = " ?" if report["ratio"] > 1 else ""  # faster than its slower part: noise
    assert f"fed / min(loader, step): {report['ratio']:.2f}x{mark} (the {limit} is the limit" \
        in table
    for name in rows:
        assert any(line.startswith(name + " ") for line in table.splitlines()), name


def test_fed_with_decode_gpu_decodes_in_the_loader_and_fed_passes(tmp_path, monkeypatch):
    """`--decode gpu`'s path (the decode injected: Pillow on the host, the rest on the CPU
    device, as tests/unit/data/test_decode_gpu_path.py runs it): every batch of the loader and fed
    passes is made by the main process's decoder, and the report says gpu."""
    data = make_image_folder(tmp_path / "jpegs", per_class=5, size=40)
    decoded = []

    def counting(files, device):
        decoded.append(len(files))
        return host_decode(files, device)

    def on_cpu(data, mode, device):
        assert mode == "gpu"
        train, val, info = data
        return DeviceDecoded(train, "cpu", counting), val, info

    monkeypatch.setattr(fed, "decode_on", on_cpu)
    out = tmp_path / "fed.json"
    result = run_in_process("bench", "--data", data, "-a", "cifar_resnet20", "--image-size",
                            "16", "-b", "4", "-j", "1", "--steps", "1", "--warmup", "0",
                            "--decode", "gpu", "--json", out)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["config"]["decode"] == "gpu" and "decode on the gpu" in result.stdout
    # 12 training images: one batch for the step's, then a loader pass and a fed pass
    assert sum(decoded) == 4 + 12 + 12 and max(decoded) == 4, decoded
    assert all(r["images_per_sec"]["median"] > 0 for r in report["results"])


def test_decode_flags_that_cannot_run_here_are_one_line(tmp_path):
    data = make_image_folder(tmp_path / "jpegs", per_class=5, size=40)
    fed_run = run_in_process("bench", "--data", data, "-a", "cifar_resnet20", "--image-size",
                             "16", "-b", "4", "--decode", "gpu", "--devices", "cpu")
    loader_run = run_in_process("bench", "--data", data, "--decode", "cpu")
    for done in (fed_run, loader_run):
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "--decode gpu needs a CUDA device" in fed_run.stderr
    assert "--decode is the fed race's" in loader_run.stderr


class _Timeline:
    """A fake clock that moves only where the fake trainer says work happens."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _FakeTrainer:
    """``train_epoch`` and the loader of a pass of ``batches`` batches of 4 from ``workers``
    workers that each make a batch in ``load`` seconds, so that batches arrive in waves of
    ``workers`` (as the workers start together), and steps of ``step`` seconds; the loop waits
    for neither more than it must."""

    def __init__(self, timeline, batches, workers, load, step):
        from types import SimpleNamespace

        self.t, self.batches, self.workers, self.load_s, self.step_s = (
            timeline, batches, workers, load, step)
        self.strategy = SimpleNamespace(devices=[])
        self.train_set = None
        self.position = SimpleNamespace(step=0)

    def arrivals(self, start):
        w = self.workers
        return [start + self.load_s * (1 + i // w) for i in range(self.batches)]

    def loader(self, dataset, train, epoch):
        import torch

        for at in self.arrivals(self.t.now):
            self.t.now = max(self.t.now, at)
            yield torch.zeros(4), None

    def after_step(self, run):
        return False

    def train_epoch(self):
        from types import SimpleNamespace

        run = SimpleNamespace(meter=SimpleNamespace(count=0))
        for at in self.arrivals(self.t.now):
            self.t.now = max(self.t.now, at) + self.step_s
            run.meter.count += 4
            self.after_step(run)
        return run.meter, False, 0.0


@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("load, step", [(0.0, 1.0), (2.0, 1.0), (8.0, 1.0)])
def test_loader_and_fed_are_rated_after_the_first_wave_on_what_ran_in_the_window(
        monkeypatch, workers, load, step):
    """The fed pass rates min(loader, step) of a loop that overlaps them perfectly, which the
    fake is: 4 img/s when steps bound it (batches ready, 1 s steps), the loader's 4 x workers
    / load img/s when the loader does. The first wave, whose batches arrive together, is
    start-up, not speed. Rated from the first batch's arrival on all but its images, a
    step-bound fed pass came out one step's images short, and a loader wave made the loader
    look faster than it is."""
    timeline = _Timeline()
    monkeypatch.setattr(fed, "clock", timeline)
    monkeypatch.setattr(fed, "synchronize", lambda devices: None)
    trainer = _FakeTrainer(timeline, batches=3 * workers, workers=workers, load=load,
                           step=step)
    loader_rate = 4 * workers / load if load else None
    wave = fed.start_up_batches(workers)
    wall, first, images, first_images = fed._fed_pass(trainer, 0, wave)
    assert (images - first_images) / (wall - first) == pytest.approx(
        min(loader_rate or 4.0, 4.0 / step))
    assert "after_step" not in vars(trainer)  # the class's own again
    if load:
        wall, first, images, first_images = fed._loader_pass(trainer, 0, wave)
        assert (images - first_images) / (wall - first) == pytest.approx(loader_rate)
        assert first == pytest.approx(load)  # the wave's wait, reported apart


def test_a_pass_shorter_than_two_waves_is_refused_in_one_line(tmp_path):
    data = make_image_folder(tmp_path / "jpegs", per_class=5, size=40)
    done = run_in_process("bench", "--data", data, "-a", "cifar_resnet20", "--image-size", "16",
                          "-b", "4", "-j", "2", "--steps", "1", "--warmup", "0")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "12 training images make 3 batch(es) of 4, too few to rate -j 2" in done.stderr
