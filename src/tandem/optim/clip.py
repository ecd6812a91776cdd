"""Gradient clipping by the whole model's norm (``clip_grad_norm_``'s rule, the norm from
:class:`~tandem.plain_norms.PlainNorms`, as torch's would be a block's under ``hybrid``), or by
value, elementwise; the same under every strategy. Clipped steps are counted on the device.
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
        """Clip now (every process alike: the norm may be a collective); returns the total
        norm (by value: the largest magnitude) before clipping."""
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
        """``{"clipped_steps": N}`` since the last call (one host read)."""
        clipped, self._clipped = self._clipped, None
        return {"clipped_steps": 0 if clipped is None else int(clipped)}
