"""An exponential moving average of a model's weights and buffers, kept beside the model.

``ema ← d ema + (1 − d) w`` after every step (integer buffers copied); ``d`` warms up as timm's
``ModelEmaV3``: the first update copies, the ``n``-th after it ``min(decay, 1 − (1 + n)^(−2/3))``.
The shadows are in the trained layout, so no step gathers; :meth:`ModelEma.swapped` puts them
in the model to validate, save or load. (torch's ``AveragedModel`` deep-copies the module,
which DDP or a hybrid's shards cannot be.)
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import nn
from torch.optim.swa_utils import get_ema_multi_avg_fn

#: timm's ``ModelEmaV3`` warm-up: d_n = 1 - (1 + n / gamma) ** -power, gamma 1
WARMUP_POWER = 2 / 3


def ema_decay(decay: float, updates: int, warmup: bool = True) -> float:
    """The decay of the update that follows ``updates`` earlier ones."""
    if updates == 0:
        return 0.0
    if not warmup:
        return decay
    return min(decay, 1.0 - (1.0 + updates) ** -WARMUP_POWER)


class ModelEma:
    """The EMA of ``model``'s parameters and buffers; ``decay`` in (0, 1)."""

    def __init__(self, model: nn.Module, decay: float, warmup: bool = True):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"ModelEma: decay {decay} must be in (0, 1)")
        self.decay, self.warmup = decay, warmup
        self.tensors = [*model.parameters(), *model.buffers()]
        self.shadow = [t.detach().clone() for t in self.tensors]
        self.updates = 0

    @torch.no_grad()
    def update(self) -> None:
        """One update from the model's tensors as they are now (after an optimizer step)."""
        decay = ema_decay(self.decay, self.updates, self.warmup)
        groups: dict[tuple, tuple[list, list]] = {}
        for shadow, tensor in zip(self.shadow, self.tensors):
            if decay == 0.0 or not shadow.is_floating_point():
                shadow.copy_(tensor.detach())
                continue
            ema, now = groups.setdefault((shadow.device, shadow.dtype), ([], []))
            ema.append(shadow)
            now.append(tensor.detach())
        average = get_ema_multi_avg_fn(decay)
        for ema, now in groups.values():
            average(ema, now, None)
        self.updates += 1

    @contextlib.contextmanager
    def swapped(self):
        """The average in the model's tensors until the block ends (a load into the model
        meanwhile becomes the average)."""
        self._exchange()
        try:
            yield
        finally:
            self._exchange()

    @torch.no_grad()
    def _exchange(self) -> None:
        for shadow, tensor in zip(self.shadow, self.tensors):
            kept = tensor.detach().clone()
            tensor.detach().copy_(shadow)
            shadow.copy_(kept)

    def state_dict(self, plain_state: Callable[[], dict]) -> dict:
        """The checkpoint's ``ema`` entry: ``plain_state()`` of the average, and the count."""
        with self.swapped():
            state = {k: v.detach().clone() for k, v in plain_state().items()}
        return {"state_dict": state, "updates": self.updates}

    def load_state_dict(self, entry: dict, load_plain: Callable[[dict], None]) -> None:
        """Take a checkpoint's ``ema`` entry, by ``load_plain(state)`` into the average."""
        with self.swapped():
            load_plain(entry["state_dict"])
        self.updates = int(entry["updates"])
