"""An exponential moving average of a model's weights and buffers, kept beside the model.

After every optimizer step, ``ema ← d ema + (1 − d) w`` for each floating-point parameter and
buffer (integer buffers, BatchNorm's ``num_batches_tracked``, are copied). ``d`` warms up as
timm's ``ModelEmaV3`` does: the first update copies the weights, and the ``n``-th after it
uses ``min(decay, 1 − (1 + n)^(−2/3))``, so that an EMA of 0.9999 follows the weights early in
a run instead of holding the initial ones for thousands of steps; without warm-up ``d`` is
``decay`` from the second update on.

The average is kept in the trained model's own layout, one shadow tensor per tensor of what a
strategy's ``setup`` returned (a split layer's blocks, on their devices, on their processes):
the average is elementwise, so a block's average is the average's block, and no step gathers
anything. To validate, save or load the average, :meth:`ModelEma.swapped` exchanges the
shadows with the model's tensors for the length of a ``with`` block, and the strategy's own
``forward_loss``, ``state_dict`` (plain keys, split layers merged) and ``load_state_dict`` see
the average as the model.

Why not ``torch.optim.swa_utils.AveragedModel``: it deep-copies the module it averages, and
what a strategy trains (DDP, a hybrid's shards and process groups) cannot be copied, while a
copy of the plain model would need the split layers gathered at every step; it also keeps no
warm-up of the decay. Its EMA helper, ``get_ema_multi_avg_fn``, does the averaging here.
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
    """The decay of the update that follows ``updates`` earlier ones (module docstring)."""
    if updates == 0:
        return 0.0
    if not warmup:
        return decay
    return min(decay, 1.0 - (1.0 + updates) ** -WARMUP_POWER)


class ModelEma:
    """The EMA of ``model``'s parameters and buffers (module docstring); ``decay`` in (0, 1)."""

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
        """The average in the model's tensors, and the model's own in the shadows, until the
        block ends (then exchanged back, whatever the block did: a load into the model
        while swapped becomes the average)."""
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
        """The checkpoint's ``ema`` entry: ``plain_state()`` (a strategy's ``state_dict`` of
        the model, asked while the average is swapped in, copied) and the update count."""
        with self.swapped():
            state = {k: v.detach().clone() for k, v in plain_state().items()}
        return {"state_dict": state, "updates": self.updates}

    def load_state_dict(self, entry: dict, load_plain: Callable[[dict], None]) -> None:
        """Take a checkpoint's ``ema`` entry, loaded by ``load_plain(state)`` (a strategy's
        ``load_state_dict`` of the model) while the average is swapped in."""
        with self.swapped():
            load_plain(entry["state_dict"])
        self.updates = int(entry["updates"])
