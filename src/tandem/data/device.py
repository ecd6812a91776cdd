"""The device half of the input pipeline: ``uint8`` batches become normalised floats there.

Images cross the worker pipe and the host-to-device copy as ``uint8`` (a quarter of the bytes)
and are normalised inside the training step, in the same float32 order as the CPU path, so
the results are bit-identical. Float datasets pass through unchanged apart from the copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from tandem.errors import UsageError

__all__ = ["Normalization", "batch_to_device"]


@dataclass(frozen=True)
class Normalization:
    """Per-channel ``mean`` and ``std`` of images whose ``uint8`` values map to ``[0, 1]``."""

    mean: tuple[float, ...]
    std: tuple[float, ...]
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def _constants(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """255, the mean and 1 / std as float32 tensors on ``device``. 255 is a 0-dim tensor
        there, not a Python number: CUDA divides by a host scalar as a multiplication by its
        reciprocal (a last bit off for about half of the 256 values), by a tensor truly, as
        the CPU does."""
        if device not in self._cache:
            mean = np.asarray(self.mean, dtype=np.float32).reshape(1, -1, 1, 1)
            inv_std = 1.0 / np.asarray(self.std, dtype=np.float32).reshape(1, -1, 1, 1)
            self._cache[device] = (torch.tensor(255.0, device=device),
                                   torch.from_numpy(mean).to(device),
                                   torch.from_numpy(inv_std).to(device))
        return self._cache[device]

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        """``(N, C, H, W)`` ``uint8`` -> normalised float32 on the same device and layout."""
        if images.dtype != torch.uint8:
            raise UsageError(f"Normalization expects uint8 images, got {images.dtype}")
        full, mean, inv_std = self._constants(images.device)
        return images.float().div_(full).sub_(mean).mul_(inv_std)


def batch_to_device(images: torch.Tensor, device: torch.device, *,
                    normalization: Normalization | None = None,
                    channels_last: bool = False) -> torch.Tensor:
    """Copy a batch to ``device``; there, ``uint8`` images are normalised, and put in
    channels-last layout when asked, else contiguous NCHW (before the float conversion, which
    keeps the layout: fewer bytes to move)."""
    images = images.to(device, non_blocking=True)
    if images.dim() == 4:  # batches may arrive channels-last (ImageFolder's do): fix the layout
        images = images.contiguous(memory_format=torch.channels_last if channels_last
                                   else torch.contiguous_format)
    if images.dtype == torch.uint8:
        if normalization is None:
            raise UsageError("a uint8 batch needs its dataset's normalization (mean and std)")
        images = normalization(images)
    return images
