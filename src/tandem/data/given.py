"""Data sets of the user's own: map-style ``(input, target)`` data sets, as ``tandem.fit`` takes
them or a ``--data package.module:function`` factory returns them, read by sample key (only the
index: they augment themselves). Targets are class indices, or tensors of them (masks).
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset

from tandem import factory
from tandem.errors import UsageError, a, param

from .dataset import SPLITS, DatasetInfo, Recipe, parse_augment, split_key

IGNORED = -100  # cross-entropy's default ignore_index: a target that counts for nothing


def _dims(shape) -> str:
    """A shape as a reader writes it: ``3x8x8``."""
    return "x".join(map(str, shape)) or "a scalar"


class GivenDataset(Dataset):
    """A user's map-style data set read by sample key; inputs become tensors, targets ints."""

    def __init__(self, dataset, name: str):
        if isinstance(dataset, IterableDataset) or not (
                hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise UsageError(f"{name} is {a(type(dataset).__name__)}, not a map-style data "
                             f"set (with __len__ and __getitem__ giving (input, target) pairs)")
        if len(dataset) == 0:
            raise UsageError(f"{name} is empty")
        self.dataset, self.name = dataset, name
        self.num_classes: int | None = None  # set by given_data: targets must lie below it
        self._labels: np.ndarray | None = None  # every target, once read (labels())
        self.shape: tuple[int, ...] | None = None  # item 0's input's, once read
        first, target = self.sample(0)
        if not first.is_floating_point():
            raise UsageError(f"{name}[0] has a {first.dtype} input: give floating-point inputs "
                             f"(normalised as the model expects)")
        self.shape = tuple(first.shape)  # of every input: what an empty batch takes
        self.dtype = first.dtype
        # () for a class index; (H, W) for a dense target (segmentation masks)
        self.target_shape = tuple(target.shape) if torch.is_tensor(target) else ()

    def __len__(self) -> int:
        return len(self.dataset)

    def sample(self, index: int) -> tuple[torch.Tensor, int | torch.Tensor]:
        """Input and target of sample ``index`` (an int, or an int64 tensor of class indices)."""
        item = self.dataset[index]
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise UsageError(f"{self.name}[{index}] is {a(type(item).__name__)}, not an "
                             f"(input, target) pair")
        inputs, target = item
        try:
            target = torch.as_tensor(target)
            if target.is_floating_point() or target.is_complex():
                raise TypeError(f"a {target.dtype} target")
            if target.dim() > 0:
                return torch.as_tensor(inputs), target.to(torch.int64)
            inputs, target = torch.as_tensor(inputs), int(target)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise UsageError(f"{self.name}[{index}]: the input must be a tensor or array and "
                             f"the target a class index or a tensor of them "
                             f"({type(exc).__name__}: {exc})") from None
        self.check_target(target, index)
        self.check_shape(inputs, index)
        return inputs, target

    def check_shape(self, inputs: torch.Tensor, index: int) -> None:
        """Refuse an input whose shape is not item 0's (else the loader fails deep inside)."""
        if self.shape is None or tuple(inputs.shape) == self.shape:
            return
        raise UsageError(f"{self.name}[{index}] has an input of shape {_dims(inputs.shape)}, but "
                         f"{self.name}[0] {_dims(self.shape)}: a batch needs one shape",
                         hint="give every input the same shape (crop, resize or pad them in "
                              "the data set)")

    def check_target(self, target: int, index: int) -> None:
        """Refuse a class index outside ``[0, num_classes)`` (the loss's ignored -100 passes)."""
        n = self.num_classes
        if n is not None and not 0 <= target < n and target != IGNORED:
            raise UsageError(f"{self.name}[{index}] has target {target}, but there are {n} "
                             f"classes (targets 0 to {n - 1})",
                             hint="fix the labels or name every class")

    def __getitem__(self, key) -> tuple[torch.Tensor, int]:
        return self.sample(split_key(key)[0])

    def check_targets(self, every: bool = False) -> None:
        """Check the targets before the run: all when listed (``targets``) or ``every``, else
        the first (the others as read)."""
        if self.target_shape or not (self._listed() is not None or every):
            self.sample(0)
            return
        for index, target in enumerate(self.labels()):
            self.check_target(int(target), index)

    def _listed(self):
        """The data set's ``targets``, one per sample, or None."""
        targets = getattr(self.dataset, "targets", None)
        return targets if targets is not None and len(targets) == len(self) else None

    def labels(self) -> np.ndarray:
        """Every target: the data set's ``targets``, else read one by one (once)."""
        if self._labels is None:
            targets = self._listed()
            if targets is not None:
                self._labels = np.asarray([int(t) for t in targets])
            else:
                self._labels = np.asarray([self.sample(i)[1] for i in range(len(self))])
        return self._labels


def given_data(train, val, classes=None, *, name: str, splits: tuple[str, ...] = SPLITS,
               augment: str | Recipe = "auto", image_size: int | None = None,
               num_classes: int | None = None, reprob: float = 0.0):
    """``(train, val, info)`` of a user's data sets, as :func:`~tandem.data.load_dataset`; the
    class count is ``classes``'s, else the data sets' own ``classes``, else the targets' max +
    1. ``augment``, ``reprob`` and ``image_size`` are refused."""
    recipe = parse_augment(augment, reprob)
    if recipe.geometry not in ("auto", "none") or recipe.policy is not None:
        shown = recipe.policy.spec if recipe.policy is not None else recipe.geometry
        raise UsageError(f"augment {shown!r} applies to tandem's own data sets; {name} does "
                         f"its own augmentation (leave augment at auto or none)")
    if recipe.reprob:
        raise UsageError(f"{param('reprob')} {recipe.reprob:g} erases tandem's own data sets' "
                         f"images; {name} does its own augmentation")
    if image_size is not None:
        raise UsageError(f"image_size {image_size} resizes tandem's own data sets; {name} "
                         f"gives its inputs at their own size")
    if train is None and "train" in splits:
        raise UsageError(f"{name} gives no training data")
    sets = {"train": GivenDataset(train, f"{name} train data") if "train" in splits else None,
            "val": GivenDataset(val, f"{name} val data")
            if val is not None and "val" in splits else None}
    present = [d for d in sets.values() if d is not None]
    if not present:
        raise UsageError(f"{name} gives no validation data")
    shapes = {d.shape for d in present}
    if len(shapes) > 1:
        raise UsageError(f"{name}: train and val inputs differ in shape "
                         f"({' vs '.join(map(str, shapes))})")
    shape = present[0].shape
    if classes is None:  # torchvision's convention: a list or tuple of names
        listed = [getattr(d, "classes", None) for d in (train, val)]
        classes = next((c for c in listed if isinstance(c, (list, tuple)) and c), None)
    if classes is not None:
        classes = [str(c) for c in classes]
        count = len(classes)
    elif num_classes is not None:
        count = num_classes
    elif present[0].target_shape:  # a mask's values include the ignored ones (e.g. 255)
        raise UsageError(f"{name} gives dense targets {present[0].target_shape}: name the "
                         f"classes (a third element, or classes=) or give num_classes")
    else:
        count = max(int(d.labels().max()) for d in present) + 1
    for d in present:
        d.num_classes = None if d.target_shape else count  # masks hold ignored values too
        d.check_targets(every=d._labels is not None)  # read: check all
    info = DatasetInfo(name, count, shape[0] if len(shape) > 1 else 1,
                       shape[-1] if shape else 1, classes)
    return sets["train"], sets["val"], info


def load_factory(reference: str, *, splits: tuple[str, ...] = SPLITS,
                 augment: str | Recipe = "auto", image_size: int | None = None,
                 num_classes: int | None = None):
    """``--data package.module:function``: call it (no arguments) for ``(train, val)`` or
    ``(train, val, class_names)``, then :func:`given_data`."""
    fn = factory.resolve(reference, "data factory")
    result = factory.call(reference, fn, "data factory")
    if not (isinstance(result, (tuple, list)) and len(result) in (2, 3)):
        raise UsageError(f"data factory '{reference}' returned {a(type(result).__name__)}, "
                         f"not (train, val) or (train, val, class_names)")
    train, val, classes = (*result, None)[:3]
    return given_data(train, val, classes, name=reference, splits=splits, augment=augment,
                      image_size=image_size, num_classes=num_classes)
