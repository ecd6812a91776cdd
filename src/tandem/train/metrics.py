"""Running sums for loss/accuracy, their reduction over processes, the JSONL log, peak memory.
Sums, not means, so one reduction gives the exact mean however unevenly samples were shared
out; accuracies are percentages. Dense outputs (segmentation) add a confusion matrix.
"""

from __future__ import annotations

import json
import math
import os
from typing import Iterable

import torch

from tandem.strategies.outputs import mean_iou, pixel_accuracy

_FIXED = 4  # the sums before a dense meter's confusion matrix


class Meter:
    """Sums of per-sample loss, top-1 and top-5 hits, plain cross-entropy and the sample
    count, on this process. The sums stay on the losses' device, so :meth:`update` never waits
    for it; reading them costs one host sync. A non-finite loss leaves :attr:`finite` False for
    good. A :attr:`dense` meter also sums confusion matrices: :attr:`acc` is then pixel accuracy."""

    def __init__(self):
        self.count = 0  # samples: a Python int, known without asking the device
        self._sums: torch.Tensor | None = None  # float64 [loss, correct, correct5, ce, *cm]
        self._host: tuple | None = None  # the last read, until an update
        self.classes: int | None = None  # dense outputs: the confusion matrix's side

    @property
    def dense(self) -> bool:
        return self.classes is not None

    @classmethod
    def from_sums(cls, loss_sum: float, correct: float, count: int,
                  correct5: float = 0.0, confusion=None, ce_sum: float = 0.0) -> "Meter":
        """A meter holding sums read elsewhere (``confusion``: nested lists or a tensor)."""
        meter = cls()
        meter.count = int(count)
        sums = [float(loss_sum), float(correct), float(correct5), float(ce_sum)]
        if confusion is not None:
            cm = torch.as_tensor(confusion, dtype=torch.float64)
            meter.classes = cm.shape[0]
            sums += cm.reshape(-1).tolist()
        meter._host = tuple(sums)
        meter._sums = torch.tensor(meter._host, dtype=torch.float64)
        return meter

    def update(self, loss: torch.Tensor, correct: torch.Tensor, count: int,
               correct5: torch.Tensor | None = None, confusion: torch.Tensor | None = None,
               ce_sum: torch.Tensor | None = None) -> None:
        """Add a batch whose *mean* loss is ``loss`` over ``count`` samples (``ce_sum``: its
        summed plain cross-entropy, if measured); no host sync."""
        if confusion is not None:  # even for an empty share: reductions need its side
            self.classes = confusion.shape[0]
        if count == 0:  # an empty share of a short last batch: nothing to count
            return
        loss = loss.detach()
        hits = [torch.as_tensor(c, device=loss.device) for c in
                (correct, correct if correct5 is None else correct5,
                 torch.zeros(()) if ce_sum is None else ce_sum.detach())]
        batch = torch.stack([loss.double() * count, *(h.double() for h in hits)])
        if confusion is not None:
            batch = torch.cat([batch, confusion.to(loss.device).reshape(-1).double()])
        self._sums = batch if self._sums is None else self._sums.to(batch.device) + batch
        self.count += count
        self._host = None

    def read(self) -> tuple:
        """``(loss_sum, correct, correct5, ce_sum, *confusion)`` on the host, cached."""
        if self._host is None:
            self._host = ((0.0,) * _FIXED if self._sums is None else tuple(self._sums.tolist()))
        return self._host

    @property
    def confusion(self) -> torch.Tensor | None:
        """A dense meter's summed confusion matrix (rows: target, columns: prediction)."""
        if not self.dense:
            return None
        return torch.tensor(self.read()[_FIXED:], dtype=torch.float64).reshape(self.classes,
                                                                         self.classes)

    @property
    def miou(self) -> float:
        """Mean IoU in percent over the counted positions (NaN for classification)."""
        return mean_iou(self.confusion) if self.dense else float("nan")

    @property
    def loss_sum(self) -> float:
        return self.read()[0]

    @property
    def correct(self) -> int:
        return round(self.read()[1])

    @property
    def correct5(self) -> int:
        return round(self.read()[2])

    @property
    def finite(self) -> bool:
        """False once any counted loss was NaN or infinite."""
        return math.isfinite(self.loss_sum)

    @property
    def loss(self) -> float:
        return self.loss_sum / self.count if self.count else float("nan")

    @property
    def ce(self) -> float:
        """Mean plain cross-entropy, where the steps measured it (0 where they did not)."""
        return self.read()[3] / self.count if self.count else float("nan")

    @property
    def acc(self) -> float:
        """Top-1 accuracy; pixel accuracy for dense outputs."""
        if self.dense:
            return pixel_accuracy(self.confusion)
        return 100.0 * self.correct / self.count if self.count else float("nan")

    @property
    def acc5(self) -> float:
        if self.dense:
            return float("nan")
        return 100.0 * self.correct5 / self.count if self.count else float("nan")

    def reduced(self, strategy, classes: int | None = None) -> "Meter":
        """A new meter of the sums over every process (one ``all_reduce_sum``)."""
        classes = self.classes if classes is None else classes
        width = _FIXED + (classes * classes if classes else 0)
        sums = (torch.zeros(width, dtype=torch.float64) if self._sums is None else self._sums)
        totals = torch.cat([sums.to(strategy.device),
                            torch.tensor([float(self.count)], dtype=torch.float64,
                                         device=strategy.device)])
        *values, count = strategy.all_reduce_sum(totals).tolist()
        confusion = (torch.tensor(values[_FIXED:]).reshape(classes, classes) if classes else None)
        return Meter.from_sums(*values[:2], round(count), values[2], confusion, values[3])

    def progress(self) -> dict:
        """The sums as a checkpoint entry (``from_sums(**meter.progress())`` rebuilds it)."""
        entry = {"loss_sum": self.loss_sum, "correct": self.correct, "count": self.count,
                 "correct5": self.correct5}
        if self.dense:
            entry["confusion"] = self.confusion.tolist()
        return entry


def _cuda_devices(devices: Iterable[torch.device]) -> list[torch.device]:
    return list(dict.fromkeys(d for d in devices if d.type == "cuda"))


def reset_peak_memory(devices: Iterable[torch.device]) -> None:
    for d in _cuda_devices(devices):
        torch.cuda.reset_peak_memory_stats(d)


def peak_memory_mb(devices: Iterable[torch.device]) -> dict[str, float] | None:
    """Peak allocated MiB per CUDA device since the last reset; ``None`` without one."""
    cuda = _cuda_devices(devices)
    if not cuda:
        return None
    return {str(d): round(torch.cuda.max_memory_allocated(d) / 2**20, 1) for d in cuda}


class MetricsLog:
    """``metrics.jsonl``: one JSON object per line, appended per epoch. ``keep_epochs`` drops
    rows past them (``None``: starts empty); ``dropped`` counts the rows dropped."""

    def __init__(self, path: str, *, keep_epochs: int | None):
        self.path, self.dropped = path, 0
        if keep_epochs is None:
            if os.path.exists(path):
                os.remove(path)
            return
        before = self.read()
        rows = [r for r in before if r.get("epoch", 0) <= keep_epochs]
        self.dropped = len(before) - len(rows)
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        os.replace(tmp, path)

    def append(self, record: dict) -> None:
        """Add one row; a non-finite number is written as ``null``, never as NaN."""
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in record.items()}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(clean, sort_keys=False) + "\n")

    def read(self) -> list[dict]:
        return self.read_rows(self.path)

    @staticmethod
    def read_rows(path: str) -> list[dict]:
        """The rows of the log at ``path`` (none when there is no file)."""
        if not os.path.exists(path):
            return []
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]


def loss_words(loss: float, smoothing: float, plain_ce: float | None) -> str:
    """``loss X`` as every line prints it; with label ``smoothing``, ``plain_ce`` beside it."""
    if not smoothing:
        return f"loss {loss:.4f}"
    return f"loss {loss:.4f} (label-smoothed {smoothing:g}; plain cross-entropy {plain_ce:.4f})"


#: what a training loss and accuracy add when the targets were mixed (mixup, cutmix): the loss
#: is against the mixed class probabilities, the accuracies count the label of larger weight
MIXED_WORDS = (" (mixed targets)", " (dominant label)")


def summary_line(r: dict, epochs: int, batches: int, smoothing: float = 0.0) -> str:
    """The line printed for metrics row ``r`` (of ``batches`` an epoch)."""
    rate = f"{r['images_per_sec']:.0f} img/s" if r["images_per_sec"] else "- img/s"
    part = f" (partial: {r['batches']}/{batches} batches)" if r["partial"] else ""
    if r.get("val_loss") is None and r.get("val_acc") is None:  # no validation set
        train = (f"pixel acc {r['train_pixel_acc']:.2f}%" if "train_pixel_acc" in r else
                 f"acc {r['train_acc']:.2f}%")
        scores = f"train loss {r['train_loss']:.4f} {train} | no validation data "
    elif "val_miou" in r:  # dense outputs
        scores = (f"train loss {r['train_loss']:.4f} pixel acc {r['train_pixel_acc']:.2f}% | "
                  f"val loss {r['val_loss']:.4f} pixel acc {r['val_pixel_acc']:.2f}% "
                  f"mIoU {r['val_miou']:.2f}% ")
    else:
        loss, acc = MIXED_WORDS if r.get("train_targets") == "mixed" else ("", "")
        scores = (f"train loss {r['train_loss']:.4f}{loss} acc{acc} {r['train_acc']:.2f}% | "
                  f"val {loss_words(r['val_loss'], smoothing, r.get('val_plain_ce'))} "
                  f"acc {r['val_acc']:.2f}% acc5 {r['val_acc5']:.2f}% ")
    if "ema_val_loss" in r:  # --model-ema: the average's validation
        scores += f"| ema val loss {r['ema_val_loss']:.4f} acc {r['ema_val_acc']:.2f}% "
    if r.get("grad_error") is not None:  # --grad-compression: the sampled step's error
        scores += f"| grad error {r['grad_error']:.1e} "
    return (f"epoch {r['epoch']}/{epochs}{part} step {r['step']}: {scores}"
            f"| {rate} {r['seconds']:.1f}s")


def score_fields(prefix: str, meter: Meter) -> dict:
    """A metrics row's scores of ``meter``: ``{prefix}_acc``, ``_acc5``, and for dense outputs
    ``_pixel_acc`` (which ``_acc`` repeats) and ``_miou``."""
    row = {f"{prefix}_acc": meter.acc, f"{prefix}_acc5": meter.acc5}
    if meter.dense:
        row[f"{prefix}_pixel_acc"] = meter.acc
        if prefix == "val":
            row["val_miou"] = meter.miou
    return row


def validated(val: Meter, smoothing: float) -> dict:
    """A metrics row's validation fields of ``val`` (with ``smoothing``, the plain loss too)."""
    return {"val_loss": val.loss, "val_finite": val.finite, **score_fields("val", val),
            **({"val_plain_ce": val.ce} if smoothing else {})}


def not_validated(train: Meter) -> dict:
    """A metrics row's validation fields without a validation set: null, not NaN."""
    return dict.fromkeys(["val_loss", "val_finite", *score_fields("val", train)])


def eval_scores(result: dict) -> str:
    """A validation pass's loss and scores, as ``tandem eval`` prints them."""
    loss = loss_words(result["loss"], result["label_smoothing"], result["plain_ce"])
    if result.get("miou") is not None:
        return f"val {loss} pixel acc {result['acc1']:.2f}% mIoU {result['miou']:.2f}%"
    return f"val {loss} acc {result['acc1']:.2f}% acc5 {result['acc5']:.2f}%"
