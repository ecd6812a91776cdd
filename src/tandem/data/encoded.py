"""The workers' half of ``--decode gpu``: a JPEG's bytes and the crop to make of it, not pixels.

The box and flip are drawn as the CPU path draws them; the main process decodes
(:mod:`.device_decode`). Anything else takes the CPU path in the worker: not a JPEG, CMYK, cut
short, a bad header, and every sample under ``--augment standard``, a policy or ``--reprob``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .decode import DECODER_ERRORS, JPEG_START, open_pillow, read_bytes
from .imagefolder import first_decodable
from .imagenet_transforms import train_draws, val_geometry
from .loader import collate
from .paired import delegating
from .transforms import SampleRandom

_JPEG_END = b"\xff\xd9"


@dataclass(frozen=True)
class Encoded:
    """One sample left to the device: the bytes, the box to cut (in ``resize``'s pixels when
    given: the val crop's whole image) and the flip; ``key``, for a substitute if refused."""

    data: bytes
    box: tuple[int, int, int, int]
    flip: bool
    key: tuple[int, int, int]
    resize: tuple[int, int] | None = None


@dataclass
class EncodedBatch:
    """A batch from a worker: ``data`` the files end to end (``jobs``: each one's place, byte
    range and crop), ``crops`` the samples it decoded itself (at ``crop_at``)."""

    size: int
    count: int
    data: torch.Tensor
    jobs: list[tuple[int, int, int, Encoded]] = field(default_factory=list)
    crops: torch.Tensor | None = None
    crop_at: list[int] = field(default_factory=list)

    def pin_memory(self) -> "EncodedBatch":
        """Pinned crops; the bytes stay (nvJPEG reads them from the host)."""
        if self.crops is not None:
            self.crops = self.crops.pin_memory()
        return self

    def files(self) -> list[torch.Tensor]:
        """Each encoded file as a 1-D uint8 tensor (views of ``data``)."""
        return [self.data[start:end] for _, start, end, _ in self.jobs]


def jpeg_size(data: bytes, path) -> tuple[int, int] | None:
    """``(width, height)`` of a complete RGB or greyscale JPEG; None for the CPU path."""
    if not data.startswith(JPEG_START) or _JPEG_END not in data[-32:]:
        return None
    try:
        img = open_pillow(data, path)
    except DECODER_ERRORS:  # the CPU path says what is wrong with it
        return None
    with img:
        ok = img.format in ("JPEG", "MPO") and img.mode in ("RGB", "L")
        return img.size if ok else None


class EncodedFolder(torch.utils.data.Dataset):
    """``base`` (an ImageFolder dataset) as :class:`Encoded` samples where it can; any other
    attribute is ``base``'s."""

    def __init__(self, base):
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    __getattr__ = delegating("base")

    def __getitem__(self, key):
        """``(Encoded, label)``, or ``((3, S, S) uint8, label)`` from the CPU path."""
        index, seed, epoch = self.base._split(key)
        sample, label = first_decodable(self.base.samples, self.base._bad, index,
                                        lambda i: self._encode(i, (index, seed, epoch)))
        if isinstance(sample, np.ndarray):
            sample = torch.from_numpy(sample).permute(2, 0, 1)
        return sample, label

    def _encode(self, i: int, key) -> Encoded | np.ndarray:
        """File ``i`` with the draws of sample ``key`` (even for a substitute)."""
        base, (index, seed, epoch) = self.base, key
        rng = SampleRandom(seed, epoch, index)  # as ImageFolderDataset.decode_key seeds it
        path = base.samples[i][0]
        if base.augment in ("imagenet", "none") and not base.recipe.pixels:
            try:
                data = read_bytes(path)
            except OSError:
                data = b""  # the CPU path fails on it again, and says so
            size = jpeg_size(data, path)
            if size is not None:
                if base.augment == "imagenet":
                    box, flip = train_draws(*size, rng)
                    return Encoded(data, box, flip, key)
                resize, box = val_geometry(*size, base.image_size)
                return Encoded(data, box, False, key, resize)
        return base._decode(i, rng)


def collate_encoded(samples: list, *, size: int) -> tuple[EncodedBatch, torch.Tensor]:
    """``(EncodedBatch, labels)`` of :class:`EncodedFolder` samples (run in the worker)."""
    encoded = [(j, s) for j, (s, _) in enumerate(samples) if isinstance(s, Encoded)]
    ends = np.cumsum([len(s.data) for _, s in encoded], dtype=np.int64).tolist()
    data = torch.frombuffer(bytearray(b"".join(s.data for _, s in encoded)) or bytearray(1),
                            dtype=torch.uint8)
    jobs = [(j, end - len(s.data), end, Encoded(b"", s.box, s.flip, s.key, s.resize))
            for (j, s), end in zip(encoded, ends)]  # the bytes sent once, in data
    crop_at = [j for j, (s, _) in enumerate(samples) if not isinstance(s, Encoded)]
    crops = collate([samples[j] for j in crop_at], shape=(3, size, size))[0] if crop_at else None
    labels = torch.tensor([int(label) for _, label in samples], dtype=torch.int64)
    return EncodedBatch(size, len(samples), data, jobs, crops, crop_at), labels
