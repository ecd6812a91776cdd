"""RandAugment (``randaugment:N:M``, timm's ``rand-mM-nN``) and TrivialAugment Wide, every draw
from the sample's own :class:`SampleRandom`, so an image is the same whoever loads it.

A signed argument is negated half the time; a geometric operation resamples bilinear or
bicubic (as timm). They work on ``uint8`` pixels (:meth:`Policy.on_float` rounds to them).
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image

from tandem.errors import UsageError, param

from .augment_ops import RAND_MAX, RAND_OPS, WIDE_BINS, WIDE_OPS, Op
from .transforms import SampleRandom

POLICY_FORMS = ("randaugment:N:M", "trivialaugment")
_FILTERS = (Image.Resampling.BILINEAR, Image.Resampling.BICUBIC)


class Policy:
    """A way to draw and apply operations to one image; ``spec`` is how ``--augment`` says it,
    ``table`` its operations by name."""

    spec = ""
    table: dict[str, Op] = {}

    def draw(self, rng: SampleRandom) -> list[tuple[str, float | None]]:  # pragma: no cover
        """The operations for one image and their magnitudes (``None``: none)."""
        raise NotImplementedError

    def __call__(self, img: Image.Image, rng: SampleRandom, fill) -> Image.Image:
        """``img`` with the operations drawn from ``rng`` applied in turn."""
        for name, magnitude in self.draw(rng):
            op = self.table[name]
            arg = () if op.level is None else (op.level(magnitude, *img.size),)
            if op.signed and rng.coin():
                arg = (-arg[0],)
            extra = (_FILTERS[rng.randint(2)], fill) if op.geometric else ()
            img = op.fn(img, *arg, *extra)
        return img

    def on_uint8(self, image: np.ndarray, rng: SampleRandom, fill) -> np.ndarray:
        """An ``(H, W, C)`` ``uint8`` image, augmented (a new array)."""
        img = Image.fromarray(image[:, :, 0] if image.shape[2] == 1 else image)
        return np.array(self(img, rng, fill)).reshape(image.shape)  # writable, contiguous

    def on_float(self, image: np.ndarray, rng: SampleRandom, fill) -> np.ndarray:
        """A ``(C, H, W)`` float image in ``[0, 1]``, augmented through ``uint8`` pixels."""
        pixels = np.clip(np.rint(image * 255.0), 0, 255).astype(np.uint8).transpose(1, 2, 0)
        out = self.on_uint8(np.ascontiguousarray(pixels), rng, fill)
        return out.transpose(2, 0, 1).astype(np.float32) / np.float32(255.0)

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other.spec == self.spec

    def __hash__(self) -> int:
        return hash(self.spec)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"


class RandAugment(Policy):
    """timm's RandAugment: ``num_ops`` picks with replacement, each applied with probability
    1/2, at ``magnitude`` in ``[0, 10]``."""

    names, table = tuple(RAND_OPS), RAND_OPS

    def __init__(self, num_ops: int, magnitude: float):
        self.num_ops, self.magnitude = num_ops, magnitude
        self.spec = f"randaugment:{num_ops}:{magnitude:g}"

    def draw(self, rng: SampleRandom) -> list[tuple[str, float | None]]:
        picks = [self.names[rng.randint(len(self.names))] for _ in range(self.num_ops)]
        return [(name, self.magnitude) for name in picks if rng.uniform(0.0, 1.0) <= 0.5]


class TrivialAugment(Policy):
    """TrivialAugment Wide: one operation, always, at a uniform bin of 31."""

    names, table = tuple(WIDE_OPS), WIDE_OPS
    spec = "trivialaugment"

    def draw(self, rng: SampleRandom) -> list[tuple[str, float | None]]:
        name = self.names[rng.randint(len(self.names))]
        return [(name, rng.randint(WIDE_BINS) if WIDE_OPS[name].level is not None else None)]


def parse_policy(text: str, name: str = "augment") -> Policy:
    """``randaugment:N:M`` or ``trivialaugment`` as a :class:`Policy`; else an error naming
    parameter ``name``."""
    if text == TrivialAugment.spec:
        return TrivialAugment()
    parts = text.split(":")
    if parts[0] == "randaugment":
        form = (f"bad {param(name)} {text!r}: give randaugment:N:M, N operations (1 or more) "
                f"of magnitude M (0 to {RAND_MAX:g}), e.g. randaugment:2:9")
        try:
            _, ops, level = parts  # a ValueError unless three parts
            num_ops, magnitude = int(ops), float(level)
        except ValueError:
            raise UsageError(form) from None
        if num_ops < 1 or not math.isfinite(magnitude) or not 0 <= magnitude <= RAND_MAX:
            raise UsageError(form)
        return RandAugment(num_ops, magnitude)
    raise UsageError(f"bad {param(name)} {text!r}: not one of {', '.join(POLICY_FORMS)}")
