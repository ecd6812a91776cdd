"""The data wait (issue 34, item 1) against a virtual clock that only loading a sample or
running a forward moves (tests/support/slow_parts.py): the wait and step sums, the first batch
apart, the share in the progress line, metrics.jsonl and TensorBoard, and the advice said once."""

import json
import re
import types

import pytest
import slow_parts
from conftest import board_scalars, run_in_process

from tandem.train import datawait
from tandem.train.datawait import DataWait
from tandem.train.progress import Progress


class Ticks:
    """A clock that reads what the test set."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_waits_and_steps_add_up_with_the_first_batch_apart():
    ticks, wait = Ticks(), DataWait()
    wait.clock = ticks
    loader = iter(range(3))

    def slow_batches():  # each batch takes 2 s to arrive, 5 s for the first
        for i, batch in enumerate(loader):
            ticks.now += 5.0 if i == 0 else 2.0
            yield batch

    for _ in wait.timed(slow_batches()):
        assert wait.share is None or wait.share > 0
        ticks.now += 3.0  # the step
    assert (wait.first, wait.data, wait.step, wait.batches) == (5.0, 4.0, 9.0, 3)
    assert wait.share == pytest.approx(4 / 13)
    assert wait.fields() == {"data_seconds": 4.0, "step_seconds": 9.0,
                             "first_batch_seconds": 5.0, "data_share": round(4 / 13, 4)}
    wait.start_epoch()
    assert wait.fields() == {} and wait.share is None


def test_a_loop_that_stops_early_still_counts_its_last_step():
    ticks = Ticks()
    wait = DataWait(clock=ticks)
    for _ in wait.timed(range(5)):
        ticks.now += 1.0
        break
    assert wait.step == 1.0 and wait.batches == 1


def test_the_advice_comes_once_above_a_fifth_and_names_the_remedy():
    wait = DataWait(clock=Ticks())
    wait.batches, wait.data, wait.step = 5, 1.0, 4.0  # exactly 20%: no advice
    assert wait.advice(1, "cpu", decode_flag=True) is None
    wait.data, wait.step = 2.0, 3.0
    line = wait.advice(1, "cuda", decode_flag=True)
    assert "40%" in line and "-j 2; now -j 1" in line and "--decode gpu" in line
    assert wait.advice(1, "cuda", decode_flag=True) is None  # once per run
    for device, flag in (("cpu", True), ("cuda", False)):  # no GPU, or no --decode yet
        other = DataWait(clock=Ticks())
        other.batches, other.data, other.step = 5, 3.0, 1.0
        line = other.advice(0, device, decode_flag=flag)
        assert "75%" in line and "--decode" not in line


def test_the_progress_line_shows_the_share_only_once_it_is_known(capsys):
    wait = DataWait(clock=Ticks())
    progress = Progress(4, 0, "epoch 1/1", bar=False, print_freq=1, wait=wait)
    meter = types.SimpleNamespace(loss=1.0, acc=50.0, acc5=100.0)
    progress.update(2, meter)
    wait.batches, wait.data, wait.step = 3, 1.0, 1.0
    progress.update(2, meter)
    first, second = capsys.readouterr().out.splitlines()
    assert "data" not in first
    assert second.endswith("img/s data 50%")


def train(tmp_path, monkeypatch, data, arch, *extra):
    monkeypatch.setattr(datawait, "time", types.SimpleNamespace(perf_counter=slow_parts.clock))
    result = run_in_process("train", "--data", f"slow_parts:{data}", "-a",
                            f"slow_parts:{arch}", "-b", "4", "--epochs", "2", "--seed", "1",
                            "--no-progress", "--out", tmp_path, *extra)
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return result, rows


def test_slow_data_is_shown_recorded_and_advised_once(tmp_path, monkeypatch):
    result, rows = train(tmp_path, monkeypatch, "slow_data", "fast_net", "-p", "2")
    shares = [int(s) for s in re.findall(r"img/s data (\d+)%", result.stdout)]
    assert len(shares) == 2 * 3 and all(s >= 90 for s in shares), result.stdout
    for row in rows:
        assert row["first_batch_seconds"] >= 4 * slow_parts.SAMPLE_SECONDS
        assert row["data_seconds"] >= 5 * 4 * slow_parts.SAMPLE_SECONDS  # 5 batches after it
        assert 0 <= row["step_seconds"] < row["data_seconds"]
        assert row["data_share"] == pytest.approx(
            row["data_seconds"] / (row["data_seconds"] + row["step_seconds"]), abs=1e-4)
    advice = [line for line in result.stdout.splitlines() if "waited for data" in line]
    assert len(advice) == 1 and "-j 2; now -j 0" in advice[0], result.stdout
    # the advice follows the first epoch's line
    lines = result.stdout.splitlines()
    assert lines.index(advice[0]) == 1 + next(i for i, line in enumerate(lines)
                                              if line.startswith("epoch 1/2 step"))


def test_a_slow_step_gets_no_advice(tmp_path, monkeypatch):
    result, rows = train(tmp_path, monkeypatch, "fast_data", "slow_net")
    assert "waited for data" not in result.stdout
    for row in rows:
        assert row["step_seconds"] >= 5 * slow_parts.FORWARD_SECONDS
        assert 0 <= row["data_seconds"] and row["first_batch_seconds"] >= 0
        assert row["data_share"] < datawait.WAIT_SHARE_WARNING


def test_tensorboard_holds_the_data_wait(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    _, rows = train(tmp_path, monkeypatch, "slow_data", "fast_net")
    board = board_scalars(tmp_path)
    for key, tag in (("data_seconds", "time/data"), ("step_seconds", "time/step"),
                     ("first_batch_seconds", "time/first_batch"), ("data_share", "data_share")):
        assert [s for s, _ in board[tag]] == [r["step"] for r in rows], tag
        assert [v for _, v in board[tag]] == pytest.approx([r[key] for r in rows], rel=1e-6)
