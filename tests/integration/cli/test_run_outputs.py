"""What `tandem train` shows and writes, checked against the run's own metrics.jsonl rows:
partial epochs, curves.png's figure, TensorBoard's events, the stop at a non-finite loss, and
training steps that never read the device.

Runs go through ``main`` in this process (tiny synthetic runs of a few steps).
"""

import contextlib
import json
import math
import re
import sys
import traceback

import pytest
import torch
from conftest import board_scalars, ok, run_in_process
from torch.utils._python_dispatch import TorchDispatchMode

pytestmark = pytest.mark.slow

# 20 train samples in batches of 6: 4 global batches (the last one short), 4 steps an epoch.
TINY = ["--data", "synthetic", "--synthetic-size", "20", "--image-size", "8",
        "--num-classes", "4", "-a", "cifar_resnet20", "-b", "6", "--no-progress", "--seed", "3"]


def rows(run):
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def figures(monkeypatch):
    """Every Figure the run builds for curves.png, as it was drawn."""
    from tandem.train import curves

    drawn, build = [], curves.build_figure

    def spy(*args, **kwargs):
        drawn.append(build(*args, **kwargs))
        return drawn[-1]

    monkeypatch.setattr(curves, "build_figure", spy)
    return drawn


def xdata(ax):
    return [list(line.get_xdata()) for line in ax.get_lines()]


def test_an_epochs_time_ends_after_its_queued_device_work(tmp_path, monkeypatch):
    """images_per_sec divides by the epoch's time: on a GPU the host is ahead of the device,
    so the clock is read after waiting for every device of the run (a no-op on the CPU)."""
    from tandem.train import loop

    seen, seconds = [], loop.EpochRun.seconds
    monkeypatch.setattr(loop, "synchronize", lambda devices: seen.append(list(devices)))
    monkeypatch.setattr(loop.EpochRun, "seconds",
                        lambda self: seen.append("clock") or seconds(self))
    ok("train", *TINY, "--epochs", "2", "--strategy", "dp", "--devices", "cpu:2", "--out",
       tmp_path)
    cpu2 = [torch.device("cpu")] * 2
    assert [x for x in seen if x in (cpu2, "clock")][:4] == [cpu2, "clock", cpu2, "clock"]


# -- item 4: a --max-steps stop is a partial epoch, and says so ---------------------------------
def test_a_max_steps_stop_is_marked_partial_in_its_line_and_row(tmp_path):
    result = ok("train", *TINY, "--epochs", "2", "--max-steps", "6", "--out", tmp_path)
    lines = result.stdout.splitlines()
    assert lines[0].startswith("epoch 1/2 step 4: train loss "), lines
    assert lines[1].startswith("epoch 2/2 (partial: 2/4 batches) step 6: train loss "), lines
    assert [(r["epoch"], r["step"], r["batches"], r["partial"]) for r in rows(tmp_path)] == [
        (1, 4, 4, False), (2, 6, 2, True)]


def test_rows_a_resume_drops_leave_curves_png_at_once(tmp_path, figures):
    run = tmp_path / "run"
    ok("train", *TINY, "--epochs", "3", "--max-steps", "6", "--out", run)
    before = (run / "curves.png").read_bytes()
    assert [len(x) for x in xdata(figures[-1].axes[0])][:2] == [2, 2]  # train, val loss
    # Resumed at step 6 (--max-steps 6 there is refused: it is reached): the partial row of
    # epoch 2 is dropped, and the figure follows at once, before the one step trained.
    epoch1 = rows(run)[0]
    figures.clear()
    ok("train", "--resume", run, "--max-steps", "7")
    assert [(r["epoch"], r["partial"]) for r in rows(run)] == [(1, False), (2, True)]
    first = figures[0]  # redrawn from the row that remains, before any training
    for ax in first.axes[:2]:
        assert all(x == [epoch1["step"]] for x in xdata(ax)), ax.get_title()
    assert len(figures) == 2 and (run / "curves.png").read_bytes() != before


# -- item 15: curves.png for a short run ------------------------------------------------------
def test_a_one_epoch_run_plots_steps_from_0_with_the_runs_name_lr_and_log_loss(tmp_path,
                                                                                figures):
    run = tmp_path / "my-run"
    ok("train", *TINY, "--epochs", "1", "--out", run)
    [row] = rows(run)
    fig = figures[-1]
    assert fig.get_suptitle() == "my-run"
    loss, acc, lr = fig.axes
    assert [ax.get_title() for ax in fig.axes] == ["loss", "accuracy", "learning rate"]
    for ax in (loss, acc):
        assert all(x == [row["step"]] for x in xdata(ax))
    for ax in fig.axes:
        assert ax.get_xlabel() == "step" and ax.get_xlim()[0] == 0
    assert loss.get_yscale() == "log"
    assert [list(line.get_ydata()) for line in loss.get_lines()] == [[row["train_loss"]],
                                                                     [row["val_loss"]]]
    # 4 classes: top-5 is 100% whatever the model does, so it is not drawn
    assert row["val_acc5"] == 100.0
    assert [line.get_label() for line in acc.get_lines()] == ["train", "validation top-1"]
    # The lr each step used, from 0 (lr 0.05) down the cosine to the row's, where the row's
    # lr sits.
    schedule, at_row = lr.get_lines()
    assert (schedule.get_label(), at_row.get_label()) == ("used at each step", "at each row")
    assert list(schedule.get_xdata()) == list(range(row["step"] + 1))
    lrs = list(schedule.get_ydata())
    assert lrs[0] == pytest.approx(0.05) and lrs == sorted(lrs, reverse=True)
    assert list(at_row.get_xdata()) == [row["step"]] and lrs[-1] == pytest.approx(row["lr"])
    assert list(at_row.get_ydata()) == [row["lr"]]


def test_lr_after_a_resume_with_more_epochs_is_the_lr_each_step_used(tmp_path, figures):
    ok("train", *TINY, "--epochs", "2", "--out", tmp_path)
    ok("train", "--resume", tmp_path, "--epochs", "3")
    first, second, third = rows(tmp_path)
    schedule, at_row = figures[-1].axes[2].get_lines()
    points = list(zip(schedule.get_xdata(), schedule.get_ydata()))
    per_epoch = second["step"] / 2
    # every step, from the first: epochs 1-2 followed the 2-epoch cosine (each row holds the
    # lrs its steps used), then the 3-epoch one from the step after row 2's on
    assert [x for x, _ in points] == pytest.approx(
        [t / per_epoch for t in range(third["step"] + 1)])
    lrs = dict(zip(range(third["step"] + 1), (lr for _, lr in points)))
    assert [[t, lrs[t]] for t, _ in first["lr_steps"] + second["lr_steps"]] == \
        first["lr_steps"] + second["lr_steps"]
    assert lrs[0] == pytest.approx(0.05) and second["lr"] == 0  # that cosine's end ...
    assert lrs[second["step"]] > 0  # ... is not what the next step used after the resume
    assert [[t, lrs[t]] for t, _ in third["lr_steps"]] == third["lr_steps"]
    assert lrs[third["step"]] == pytest.approx(third["lr"])
    # each row's dot sits on that line: the lr its next step used (row 2's is not its 0)
    assert list(at_row.get_ydata()) == [lrs[r["step"]] for r in (first, second, third)]


def test_two_epochs_and_a_partial_one_plot_epochs(tmp_path, figures):
    ok("train", *TINY, "--epochs", "3", "--max-steps", "10", "--out", tmp_path)
    fig = figures[-1]
    loss = fig.axes[0]
    assert loss.get_xlabel() == "epoch"
    train, val, partial = loss.get_lines()
    assert list(train.get_xdata()) == [1, 2, 2.5]  # the partial epoch at the half trained
    assert partial.get_label() == "partial epoch" and set(partial.get_xdata()) == {2.5}
    schedule, at_row = fig.axes[2].get_lines()
    assert list(at_row.get_ydata()) == [r["lr"] for r in rows(tmp_path)]
    assert list(schedule.get_xdata()) == pytest.approx([t / 4 for t in range(11)])  # to step 10


# -- item 18: TensorBoard -----------------------------------------------------------------------
TAGS = {"train_loss": "loss/train", "val_loss": "loss/val", "train_acc": "top1/train",
        "val_acc": "top1/val", "train_acc5": "top5/train", "val_acc5": "top5/val", "lr": "lr",
        "images_per_sec": "images_per_sec"}


def assert_board_holds_rows(run):
    board, kept = board_scalars(run), rows(run)
    for key, tag in TAGS.items():
        want = [(r["step"], r[key]) for r in kept]
        assert [s for s, _ in board[tag]] == [s for s, _ in want], tag
        assert [v for _, v in board[tag]] == pytest.approx([v for _, v in want], rel=1e-6), tag


def test_tensorboard_events_hold_the_numbers_of_metrics_jsonl(tmp_path):
    ok("train", *TINY, "--epochs", "2", "--out", tmp_path)
    assert_board_holds_rows(tmp_path)


def test_a_resumed_run_keeps_one_event_per_step_and_none_of_the_dropped_row(tmp_path):
    ok("train", *TINY, "--epochs", "3", "--max-steps", "6", "--out", tmp_path)
    assert [s for s, _ in board_scalars(tmp_path)["loss/train"]] == [4, 6]  # 6: the partial epoch
    ok("train", "--resume", tmp_path)
    assert [r["step"] for r in rows(tmp_path)] == [4, 8, 12]
    assert_board_holds_rows(tmp_path)  # step 6's partial row is gone with it


def test_without_tensorboard_nothing_is_written_or_said(tmp_path, monkeypatch):
    def masked(result, run):  # timings and the directory apart
        return re.sub(r"\d+(\.\d+)?", "N", result.stdout.replace(str(run), "RUN"))

    with_board = ok("train", *TINY, "--epochs", "1", "--out", tmp_path / "a")
    for name in ("tensorboard", "torch.utils.tensorboard"):  # as if it were not installed
        monkeypatch.setitem(sys.modules, name, None)
    without = ok("train", *TINY, "--epochs", "1", "--out", tmp_path / "b")
    assert (tmp_path / "a" / "tb").is_dir() and not (tmp_path / "b" / "tb").exists()
    assert masked(without, tmp_path / "b") == masked(with_board, tmp_path / "a")
    assert without.stderr == with_board.stderr == ""


# -- item 11: a non-finite loss stops the run -------------------------------------------------
def finite_rows(run) -> bool:
    numbers = [v for r in rows(run) for k, v in r.items() if k.endswith(("loss", "acc", "acc5"))]
    return all(isinstance(v, float) and math.isfinite(v) for v in numbers)


def finite_weights(path) -> bool:
    state = torch.load(path, weights_only=True)["state_dict"]
    return all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point())


def one_error_line(result, status=3) -> str:
    assert result.returncode == status, result.stderr
    assert "Traceback" not in result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("tandem: error: ")
    return line


class _InfGrad(torch.autograd.Function):
    """The identity, whose gradient is infinite: a finite loss that overflows backward."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * math.inf


@pytest.fixture
def overflow(monkeypatch):
    """``overflow(n, part)``: from the n-th training batch on, the ``"loss"`` turns infinite,
    or its ``"grad"`` (the loss stays finite); ``"val"``: every validation loss is infinite.
    A model that overflows, the same on every machine, unlike a high --lr."""
    from tandem.train import build as build_module

    make = build_module.make_criterion

    def patch(n, part="loss"):
        class Overflowing(torch.nn.Module):
            def __init__(self, criterion):
                super().__init__()
                self.criterion, self.calls = criterion, 0

            def forward(self, outputs, targets):
                loss = self.criterion(outputs, targets)
                if not torch.is_grad_enabled():
                    return loss * math.inf if part == "val" else loss
                self.calls += 1
                if self.calls < n or part == "val":
                    return loss
                return loss * math.inf if part == "loss" else _InfGrad.apply(loss)

        monkeypatch.setattr(build_module, "make_criterion",
                            lambda *args: Overflowing(make(*args)))

    patch.off = monkeypatch.undo
    yield patch
    monkeypatch.undo()


def test_lr_1000_stops_at_non_finite_numbers_keeping_the_last_finite_checkpoint(tmp_path):
    run = tmp_path / "run"
    line = one_error_line(run_in_process("train", *TINY, "--epochs", "2", "--lr", "1000",
                                         "--save-every", "1", "--out", run))
    assert "became non-finite by epoch 1, step " in line and "(--lr 1000)" in line
    kept = re.search(r"keeping (\S+) from step (\d+) ", line)
    assert kept and kept[1] == str(run / "checkpoint.pt"), line
    ckpt = torch.load(run / "checkpoint.pt", weights_only=True)
    assert ckpt["data_position"]["step"] == int(kept[2]) and finite_weights(kept[1])
    assert finite_rows(run) and not (run / "best.pt").exists()  # no best from NaN


def test_the_first_non_finite_loss_shown_stops_the_run_and_the_hint_works(tmp_path, overflow):
    run = tmp_path / "run"
    overflow(3, "loss")
    result = run_in_process("train", *TINY, "--epochs", "2", "-p", "1", "--save-every", "2",
                            "--out", run)
    line = one_error_line(result)
    # Seen on the line printed for batch 3, and stopped there (not at the epoch's end).
    assert result.stdout.splitlines()[-1].startswith("epoch 1/2 [3/4] loss inf "), result.stdout
    assert line.startswith("tandem: error: train loss became non-finite by epoch 1, step 3 "
                           f"(--lr 0.05); stopped, keeping {run / 'checkpoint.pt'} from step 2 ")
    assert torch.load(run / "checkpoint.pt", weights_only=True)["data_position"]["step"] == 2
    assert finite_weights(run / "checkpoint.pt") and rows(run) == []
    # What the line says to do runs (with a model that no longer overflows).
    overflow.off()
    from tandem.train.loop import lr_may_change

    if lr_may_change():
        command = line.split(": ")[-1].split()
        assert command[:4] == ["tandem", "train", "--resume", str(run)], line
        ok(*command[2:], "--max-steps", "3")
    else:
        assert f"--pretrained {run / 'checkpoint.pt'} --lr 0.005 --out NEW_DIR" in line
        ok("train", *TINY, "--pretrained", run / "checkpoint.pt", "--lr", "0.005",
           "--max-steps", "1", "--out", tmp_path / "new")


def test_weights_that_overflow_under_a_finite_loss_are_never_saved(tmp_path, overflow):
    overflow(2, "grad")  # step 2's update makes the weights infinite; its loss is finite
    line = one_error_line(run_in_process("train", *TINY, "--epochs", "1", "--save-every", "1",
                                         "--out", tmp_path))
    assert "the weights became non-finite by epoch 1, step 2 " in line
    assert f"keeping {tmp_path / 'checkpoint.pt'} from step 1 " in line
    assert finite_weights(tmp_path / "checkpoint.pt")


def test_a_non_finite_val_loss_is_a_flagged_row_and_no_best(tmp_path, overflow):
    """Issue 30: an overflowing validation (fp16 logits) does not stop a healthy run."""
    overflow(1, "val")
    result = run_in_process("train", *TINY, "--epochs", "2", "--out", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "val loss inf" in result.stdout or "val loss nan" in result.stdout, result.stdout
    assert [r["val_finite"] for r in rows(tmp_path)] == [False, False]
    assert not (tmp_path / "best.pt").exists()


def test_a_non_finite_loss_before_any_save_leaves_no_checkpoint_and_says_so(tmp_path, overflow):
    overflow(2, "loss")
    line = one_error_line(run_in_process("train", *TINY, "--epochs", "2", "--out", tmp_path))
    assert "train loss became non-finite by epoch 1, step 4 " in line  # seen at the epoch's end
    assert "before any checkpoint was saved" in line and "--overwrite" in line
    assert not (tmp_path / "checkpoint.pt").exists() and not (tmp_path / "best.pt").exists()
    assert rows(tmp_path) == []


# -- item 11: a training step reads nothing from the device ------------------------------------
class _Reads(TorchDispatchMode):
    """Counts ``aten::_local_scalar_dense`` (what ``.item()``, ``float()``, ``int()`` and
    ``.tolist()`` of a tensor run: a host sync on an accelerator) in a training step.

    In the main thread, a read counts when ``Trainer.train_epoch`` is on the stack (but not
    its data loader: the sampler's order is made on the host). In a replica thread (``in_replica``)
    every read under grad counts: validation's forward runs without grad.
    """

    def __init__(self, tally, in_replica=False):
        super().__init__()
        self.tally, self.in_replica = tally, in_replica

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.in_replica:
            self.tally["replica ops"] += 1
        if func is torch.ops.aten._local_scalar_dense.default:
            self.tally["reads"] += 1
            names = [(f.name, f.filename) for f in traceback.extract_stack()]
            in_step = (torch.is_grad_enabled() if self.in_replica else
                       any(n == "train_epoch" for n, _ in names)
                       and not any(n == "loader" or "torch/utils/data" in p for n, p in names))
            if in_step:
                self.tally["in steps"] += 1
                self.tally.setdefault("where", []).append(traceback.format_stack()[-6:-1])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("strategy, threads", [
    (["--strategy", "single"], False),
    (["--strategy", "dp", "--devices", "cpu:2"], True),  # replicas in threads
    (["--strategy", "balanced", "--devices", "cpu:2"], True),
], ids=["single", "dp", "balanced"])
def test_training_steps_that_print_nothing_read_nothing_from_the_device(tmp_path, monkeypatch,
                                                                        strategy, threads):
    import importlib

    parallel_apply = importlib.import_module("tandem.parallel.parallel_apply")
    tally = {"reads": 0, "in steps": 0, "replica ops": 0}
    enter = parallel_apply._State.enter

    @contextlib.contextmanager
    def counted(self, device):  # each replica thread counts too
        with enter(self, device), _Reads(tally, in_replica=True):
            yield

    monkeypatch.setattr(parallel_apply._State, "enter", counted)
    with _Reads(tally):
        ok("train", *TINY, *strategy, "--epochs", "1", "--max-steps", "3", "--out", tmp_path)
    assert tally["in steps"] == 0, "".join(sum(tally["where"], []))
    # The counter saw the end of the epoch's reads, and the replica threads where there are.
    assert tally["reads"] > 0
    assert (tally["replica ops"] > 0) == threads


def test_a_ddp_step_reads_nothing_from_the_device(tmp_path, monkeypatch):
    """ddp in one process (world 1, gloo): its loss all-reduce stays on the device, and 9
    steps that print nothing read nothing (the ranks' vote, under several processes, is a CPU
    tensor read one step late: tests/integration/torchrun/test_agreement.py)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                       "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": "t"}.items():
        monkeypatch.setenv(key, value)
    tally = {"reads": 0, "in steps": 0, "replica ops": 0}
    with _Reads(tally):
        ok("train", *TINY, "--strategy", "ddp", "--devices", "cpu", "--epochs", "3",
           "--max-steps", "9", "--print-freq", "0", "--out", tmp_path)
    where = ["".join(w) for w in tally.get("where", [])]
    assert tally["in steps"] == 0, "".join(where)
    assert [r["step"] for r in rows(tmp_path)] == [4, 8, 9]
