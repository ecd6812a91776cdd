"""Dense-output metrics against sums done by hand: Meter, metrics rows, printed lines, TensorBoard."""

import math

import pytest
import torch

from tandem.strategies import create_strategy
from tandem.train.metrics import Meter, score_fields, summary_line
from tandem.train.tensorboard import TensorBoard


def _dense_meter():
    meter = Meter()
    meter.update(torch.tensor(0.5), torch.tensor(3), 2, None, torch.tensor([[2, 1], [0, 1]]))
    meter.update(torch.tensor(1.0), torch.tensor(1), 1, None, torch.tensor([[0, 0], [1, 1]]))
    return meter


def test_meter_sums_confusion_matrices():
    meter = _dense_meter()
    assert meter.dense and meter.count == 3
    assert meter.loss == pytest.approx((0.5 * 2 + 1.0) / 3)
    assert meter.confusion.tolist() == [[2, 1], [1, 2]]
    assert meter.acc == pytest.approx(100 * 4 / 6)  # pixel accuracy
    assert meter.miou == pytest.approx(100 * (2 / 4 + 2 / 4) / 2)
    assert math.isnan(meter.acc5)
    again = Meter.from_sums(**meter.progress())  # a checkpoint's epoch progress
    assert again.confusion.tolist() == meter.confusion.tolist() and again.miou == meter.miou
    reduced = meter.reduced(create_strategy("single", [torch.device("cpu")]))
    assert reduced.confusion.tolist() == meter.confusion.tolist() and reduced.count == 3


def test_an_empty_share_still_knows_the_matrix_side():
    meter = Meter()
    meter.update(torch.tensor(0.0), torch.tensor(0), 0, None, torch.zeros(3, 3, dtype=torch.long))
    reduced = meter.reduced(create_strategy("single", [torch.device("cpu")]))
    assert reduced.dense and reduced.confusion.shape == (3, 3) and math.isnan(reduced.miou)


def test_rows_lines_and_tensorboard_show_pixel_acc_and_miou():
    meter = _dense_meter()
    row = {"epoch": 1, "step": 4, "batches": 4, "partial": False, "train_loss": meter.loss,
           **score_fields("train", meter), "val_loss": meter.loss, **score_fields("val", meter),
           "images_per_sec": 10.0, "seconds": 1.0}
    assert row["val_pixel_acc"] == row["val_acc"] == meter.acc
    assert row["val_miou"] == meter.miou and "train_miou" not in row
    line = summary_line(row, 2, 4)
    assert f"pixel acc {meter.acc:.2f}% mIoU {meter.miou:.2f}%" in line and "acc5" not in line

    class Writer:
        def __init__(self, *args, **kwargs):
            self.scalars = {}

        def add_scalar(self, tag, value, global_step):
            self.scalars[tag] = value

        def flush(self):
            pass

    board = TensorBoard(Writer, "unused")
    board.add_row(row)
    assert board.writer.scalars["miou/val"] == meter.miou
    assert board.writer.scalars["pixel_acc/val"] == meter.acc
    assert "top5/val" not in board.writer.scalars  # NaN for dense runs: left out


def test_classification_rows_keep_their_keys():
    meter = Meter()
    meter.update(torch.tensor(0.5), torch.tensor(1), 2, torch.tensor(2))
    assert score_fields("val", meter) == {"val_acc": 50.0, "val_acc5": 100.0}
