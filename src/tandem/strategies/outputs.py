"""What a step measures from a model's outputs: the logits it picks, and the hits it counts.

Kinds of output, told apart by shape:

* classification: ``(N, classes)`` logits and ``(N,)`` class targets; top-1 and top-5 hits
  (class-probability targets, mixup's and cutmix's, count their dominant label).
* dense (segmentation): ``(N, classes, *positions)`` logits and ``(N, *positions)`` class
  targets; a ``classes x classes`` confusion matrix (rows: target) over the positions whose
  target is not ``ignore_index``. Pixel accuracy and mean IoU are read from the matrix summed
  over batches, devices and processes, so they are exact over a whole set.

Nothing here reads the device: counts stay tensors where the outputs are.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tandem.errors import UsageError, a


#: torch's ``CrossEntropyLoss`` default, used when the criterion has no ``ignore_index``
DEFAULT_IGNORE_INDEX = -100


def pick_output(output: Any, key: str | int | None) -> torch.Tensor:
    """The logits in a model's ``output``: ``output[key]`` for a dict key or a tuple index,
    ``output`` itself for ``key=None``. A missing key is an error naming what there is."""
    if key is None:
        if isinstance(output, torch.Tensor):
            return output
        kind = "dict" if isinstance(output, dict) else type(output).__name__
        raise UsageError(f"the model returned {a(kind)}, not a tensor: pick the logits with "
                         f"output_key= (--output-key), a dict key or a tuple index")
    if isinstance(output, dict):
        if key not in output:
            raise UsageError(f"output_key {key!r} is not in the model's output; its keys: "
                             f"{', '.join(map(repr, output))}")
        return output[key]
    if isinstance(output, (tuple, list)):
        try:
            return output[int(key)]
        except (ValueError, IndexError):
            raise UsageError(f"output_key {key!r} is not an index of the model's output, a "
                             f"{type(output).__name__} of {len(output)}") from None
    raise UsageError(f"output_key {key!r} given, but the model returned a "
                     f"{type(output).__name__}, not a dict or a tuple")


def is_dense(outputs: torch.Tensor, targets: torch.Tensor) -> bool:
    """True for per-position logits ``(N, C, ...)`` with class targets ``(N, ...)``."""
    return (outputs.dim() > 2 and not targets.is_floating_point()
            and targets.dim() == outputs.dim() - 1)


def top5_hits(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Samples whose target is among the 5 highest outputs (all of them with < 5 classes)."""
    if outputs.shape[0] == 0:
        return torch.zeros((), dtype=torch.long, device=outputs.device)
    top = outputs.topk(min(5, outputs.shape[1]), dim=1).indices
    return (top == targets.to(outputs.device)[:, None]).any(1).sum()


def confusion_matrix(outputs: torch.Tensor, targets: torch.Tensor,
                     ignore_index: int = DEFAULT_IGNORE_INDEX) -> torch.Tensor:
    """``(C, C)`` int64 counts: ``[t, p]`` positions of target class ``t`` predicted as ``p``,
    targets ``ignore_index`` (or outside ``0..C-1``) left out, into an extra bin (no host sync)."""
    classes = outputs.shape[1]
    targets = targets.to(outputs.device)
    predicted = outputs.argmax(1)
    valid = (targets != ignore_index) & (targets >= 0) & (targets < classes)
    bins = torch.where(valid, targets * classes + predicted,
                       torch.full_like(targets, classes * classes))
    counts = torch.zeros(classes * classes + 1, dtype=torch.long, device=outputs.device)
    counts.index_add_(0, bins.reshape(-1), torch.ones_like(bins.reshape(-1)))
    return counts[:-1].reshape(classes, classes)


def hits(outputs: torch.Tensor, targets: torch.Tensor, ignore_index: int):
    """``(correct, correct5, confusion)`` for one chunk: top-1/top-5 hits and ``None`` for
    classification; correct positions, ``None`` and the confusion matrix for dense outputs."""
    targets = targets.to(outputs.device)
    if targets.is_floating_point() and targets.dim() == 2 and outputs.dim() == 2:
        targets = targets.argmax(1)
    if is_dense(outputs, targets):
        confusion = confusion_matrix(outputs, targets, ignore_index)
        return confusion.diagonal().sum(), None, confusion
    if outputs.dim() != 2 or targets.dim() != 1:
        raise UsageError(f"cannot score outputs of shape {tuple(outputs.shape)} against targets "
                         f"of shape {tuple(targets.shape)}: expected (N, classes) with (N,), or "
                         f"(N, classes, H, W) with (N, H, W)")
    correct = (outputs.argmax(1) == targets).sum()
    return correct, top5_hits(outputs, targets), None


def label_smoothing(criterion) -> float:
    """The label smoothing of a ``CrossEntropyLoss`` ``criterion`` (0 for any other loss)."""
    return float(criterion.label_smoothing) if isinstance(criterion, nn.CrossEntropyLoss) else 0.0


def plain_ce_sum(criterion, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
    """The summed cross-entropy *without* label smoothing of one classification chunk, when
    ``criterion`` is a label-smoothed ``CrossEntropyLoss`` and no gradient is taken (a
    validation pass), else ``None``: the plain loss printed beside the smoothed one."""
    if not label_smoothing(criterion) or torch.is_grad_enabled() or outputs.dim() != 2:
        return None
    work = torch.promote_types(outputs.dtype, torch.float32)  # float32 at least, as CE's autocast
    return nn.functional.cross_entropy(outputs.to(work), targets.to(outputs.device),
                                       weight=criterion.weight,
                                       ignore_index=criterion.ignore_index, reduction="sum")


def pixel_accuracy(confusion: torch.Tensor) -> float:
    """Percent of counted positions predicted right (NaN when none was counted)."""
    total = float(confusion.sum())
    return 100.0 * float(confusion.diagonal().sum()) / total if total else float("nan")


def mean_iou(confusion: torch.Tensor) -> float:
    """Mean over classes of ``|target ∩ predicted| / |target ∪ predicted|``, in percent; a
    class absent from both targets and predictions is left out (NaN when all are)."""
    c = confusion.double()
    inter = c.diagonal()
    union = c.sum(0) + c.sum(1) - inter
    present = union > 0
    if not bool(present.any()):
        return float("nan")
    return 100.0 * float((inter[present] / union[present]).mean())
