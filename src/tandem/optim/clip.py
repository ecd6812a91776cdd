"""Gradient clipping by the whole model's norm, or by value, the same under every strategy.

``--clip-grad NORM`` scales every gradient by ``min(1, NORM / (‖g‖ + 1e-6))``, ``‖g‖`` the norm
of the whole model's gradient, as ``torch.nn.utils.clip_grad_norm_`` does. torch's function
takes the norm of the tensors it is handed, which under ``hybrid`` and ``hybrid-ddp`` are
blocks of the model's layers (and under ``hybrid-ddp`` only this process's blocks): so the norm
comes from :class:`~tandem.plain_norms.PlainNorms` (the strategy's), and torch's
``clip_grads_with_norm_`` applies it. Under ``ddp`` it runs after DDP has reduced the
gradients (the loop clips after the backward of a step's last micro-batch), so every rank
scales the same gradient by the same factor. ``--clip-mode value`` clamps each element to
``[-NORM, NORM]`` (``clip_grad_value_``), elementwise and so exact under any split.

Under fp16's grad scaling the loop unscales the gradients first (``GradScaler.unscale_``): the
threshold is the true gradient's. Each step where the clip changed a gradient is counted on
the device (no host sync); :meth:`GradClip.fields` reads and resets the count.
"""

from __future__ import annotations

import torch
from torch.nn.utils import clip_grad_value_, clip_grads_with_norm_

from tandem.plain_norms import PlainNorms

#: what ``--clip-mode`` accepts
CLIP_MODES = ("norm", "value")


class GradClip:
    """Clip the gradients of ``norms.params`` (the optimizer's parameters) to ``threshold``
    by the plain model's total norm (``mode`` ``"norm"``) or by value (``"value"``)."""

    def __init__(self, threshold: float, mode: str, norms: PlainNorms):
        if threshold <= 0 or mode not in CLIP_MODES:
            raise ValueError(f"GradClip: bad threshold {threshold} or mode {mode!r}")
        self.threshold, self.mode, self.norms = threshold, mode, norms
        self._clipped: torch.Tensor | None = None  # steps it changed, on the device

    @torch.no_grad()
    def __call__(self) -> torch.Tensor:
        """Clip now (every process alike: under ``hybrid-ddp`` the norm is a collective);
        returns the total norm (by value: the largest magnitude) before clipping."""
        params = [p for p in self.norms.params if p.grad is not None]
        if self.mode == "value":
            grads = [p.grad.detach().abs().amax().to(self.norms.device) for p in params
                     if p.grad.numel()]
            before = torch.stack(grads).amax() if grads else torch.zeros((), device=self.norms.device)
            clip_grad_value_(params, self.threshold)
        else:
            before = self.norms.total(params, [p.grad for p in params]).sqrt()
            clip_grads_with_norm_(params, self.threshold, before.to(params[0].dtype)
                                  if params else before)
        bit = (before > self.threshold).long()
        self._clipped = bit if self._clipped is None else self._clipped + bit
        return before

    def fields(self) -> dict:
        """``{"clipped_steps": N}``: the steps since the last call whose gradients were
        clipped (one host read), for the epoch's metrics row."""
        clipped, self._clipped = self._clipped, None
        return {"clipped_steps": 0 if clipped is None else int(clipped)}
