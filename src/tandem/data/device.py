"""The device half of the input pipeline: ``uint8`` batches (a quarter of the bytes to copy)
become normalised floats there, in the CPU path's float32 order, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from tandem.errors import UsageError


@dataclass(frozen=True)
class Normalization:
    """Per-channel ``mean`` and ``std`` of images whose ``uint8`` values map to ``[0, 1]``."""

    mean: tuple[float, ...]
    std: tuple[float, ...]
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def _constants(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """255, the mean and 1 / std on ``device``; 255 as a tensor: CUDA divides by a host
        scalar as a multiplication by its reciprocal (a last bit off for half the values)."""
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
    """Copy a batch to ``device``, lay it out (channels-last when asked) and normalise a
    ``uint8`` one there."""
    images = images.to(device, non_blocking=True)
    if images.dim() == 4:  # batches may arrive channels-last (ImageFolder's do): fix the layout
        images = images.contiguous(memory_format=torch.channels_last if channels_last
                                   else torch.contiguous_format)
    if images.dtype == torch.uint8:
        if normalization is None:
            raise UsageError("a uint8 batch needs its dataset's normalization (mean and std)")
        images = normalization(images)
    return images
