"""mixup and cutmix as timm's ``Mixup`` in "batch" mode, drawn once per global batch from
``(seed, epoch, batch)``, never from a process's own generator; the mix itself on the device.

A drawn permutation gives each sample its partner, which another rank may hold: the loader
loads it too (:mod:`.paired`). :func:`mix` runs after normalisation (mixing is affine);
targets become class probabilities.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from tandem.errors import UsageError, param

from .transforms import mix_seed

_SALT = 0x6D6978  # "mix": this stream's own, apart from the epoch order's and the samples'


@dataclass(frozen=True)
class Mixing:
    """The mix settings of a run (``--mixup``, ``--cutmix``, ``--mix-prob``,
    ``--mix-switch-prob``) and the classes its soft targets span."""

    mixup: float = 0.0  # Beta's alpha for mixup; 0: off
    cutmix: float = 0.0  # Beta's alpha for cutmix; 0: off
    prob: float = 1.0  # of mixing a batch at all
    switch_prob: float = 0.5  # of cutmix rather than mixup, when both are on
    num_classes: int = 0

    def __post_init__(self):
        for name, value in (("mixup", self.mixup), ("cutmix", self.cutmix)):
            if not (math.isfinite(value) and value >= 0):
                raise UsageError(f"bad {param(name)} {value:g}: must be >= 0 (Beta's alpha; "
                                 f"0 is off, e.g. 0.2 for mixup, 1.0 for cutmix)")
        for name, value in (("mix_prob", self.prob), ("mix_switch_prob", self.switch_prob)):
            if not 0.0 <= value <= 1.0:
                raise UsageError(f"bad {param(name)} {value:g}: must be in [0, 1]")
        if self.active and self.num_classes < 1:
            raise UsageError(f"mixing needs the classes the targets span, got {self.num_classes}")

    @property
    def active(self) -> bool:
        return (self.mixup > 0 or self.cutmix > 0) and self.prob > 0

    def draw(self, seed: int, epoch: int, batch: int, size: int) -> MixDraw:
        """The draws of global batch ``batch`` of ``epoch`` (``size`` samples), in timm's
        order; every process draws the same."""
        g = np.random.Generator(np.random.Philox(key=mix_seed(seed, epoch, batch, _SALT)))
        partner = tuple(int(i) for i in g.permutation(size))
        centre = (float(g.random()), float(g.random()))
        kind, lam = "none", 1.0
        if self.active and g.random() < self.prob:
            if self.mixup > 0 and self.cutmix > 0:
                kind = "cutmix" if g.random() < self.switch_prob else "mixup"
            else:
                kind = "mixup" if self.mixup > 0 else "cutmix"
            alpha = self.mixup if kind == "mixup" else self.cutmix
            lam = float(g.beta(alpha, alpha))
        return MixDraw(partner, kind, lam, centre)


@dataclass(frozen=True)
class MixDraw:
    """One global batch's draws: ``partner[p]`` (whom sample ``p`` mixes with), ``kind``
    (``none``, ``mixup``, ``cutmix``), Beta's ``lam``, cutmix's box centre (fractions)."""

    partner: tuple[int, ...]
    kind: str
    lam: float
    centre: tuple[float, float]


@dataclass(frozen=True)
class Pairing:
    """How one share of a global batch is mixed: for each own sample, where its partner sits
    in what the share loaded (its own, then ``extra``: the partners it lacks)."""

    draw: MixDraw
    gather: tuple[int, ...]
    extra: tuple[int, ...]
    num_classes: int

    def mix(self, images: torch.Tensor, labels: torch.Tensor):
        """:func:`mix` of what the share loaded (on the device)."""
        return mix(images, labels, self)


def pair(draw: MixDraw, lo: int, hi: int, num_classes: int) -> Pairing:
    """The :class:`Pairing` of the share ``[lo, hi)`` of a global batch."""
    if draw.kind == "none":
        return Pairing(draw, tuple(range(hi - lo)), (), num_classes)
    extra, gather = [], []
    for p in range(lo, hi):
        q = draw.partner[p]
        if lo <= q < hi:
            gather.append(q - lo)
        else:
            gather.append(hi - lo + len(extra))
            extra.append(q)
    return Pairing(draw, tuple(gather), tuple(extra), num_classes)


def cut_box(centre: tuple[float, float], lam: float, height: int, width: int
            ) -> tuple[int, int, int, int]:
    """cutmix's ``(top, bottom, left, right)``: timm's ``rand_bbox``, a box of sides
    ``int(side * sqrt(1 - lam))`` around the drawn centre, clipped to the image."""
    ratio = math.sqrt(1.0 - lam)
    cut_h, cut_w = int(height * ratio), int(width * ratio)
    cy, cx = min(int(centre[0] * height), height - 1), min(int(centre[1] * width), width - 1)
    top, bottom = max(cy - cut_h // 2, 0), min(cy + cut_h // 2, height)
    left, right = max(cx - cut_w // 2, 0), min(cx + cut_w // 2, width)
    return top, bottom, left, right


def soft_targets(own: torch.Tensor, partner: torch.Tensor, lam: float, classes: int,
                 dtype: torch.dtype) -> torch.Tensor:
    """``(N, classes)``: ``lam * onehot(own) + (1 - lam) * onehot(partner)`` (a target outside
    ``[0, classes)``, such as an ignored one, has no row of its own)."""
    def onehot(labels):
        valid = (labels >= 0) & (labels < classes)
        hot = F.one_hot(labels.clamp(0, classes - 1), classes).to(dtype)
        return hot * valid.unsqueeze(1).to(dtype)
    return onehot(own).mul_(lam).add_(onehot(partner).mul_(1.0 - lam))


def mix(images: torch.Tensor, labels: torch.Tensor, pairing: Pairing):
    """``(mixed images, probabilities)`` of what a share loaded; a row depends on its sample
    and its partner alone, not on the share (cutmix's ``lam`` is the box's true area)."""
    draw, n = pairing.draw, len(pairing.gather)
    if images.dim() != 4:
        raise UsageError(f"mixup and cutmix mix images (N, C, H, W), got a batch of shape "
                         f"{tuple(images.shape)}")
    if labels.dim() != 1 or labels.is_floating_point():
        raise UsageError(f"mixup and cutmix mix class-index targets, got targets of shape "
                         f"{tuple(labels.shape)} ({labels.dtype})")
    gather = torch.tensor(pairing.gather, dtype=torch.long).to(images.device, non_blocking=True)
    own, partner = images[:n], images.index_select(0, gather)
    lam = draw.lam
    if draw.kind == "mixup":
        mixed = own.mul(lam).add_(partner.mul_(1.0 - lam))
    elif draw.kind == "cutmix":
        height, width = images.shape[-2:]
        top, bottom, left, right = cut_box(draw.centre, lam, height, width)
        mixed = own.clone()
        mixed[:, :, top:bottom, left:right] = partner[:, :, top:bottom, left:right]
        lam = 1.0 - (bottom - top) * (right - left) / float(height * width)
    else:
        mixed = own
    dtype = images.dtype if images.is_floating_point() else torch.float32
    targets = soft_targets(labels[:n], labels.index_select(0, gather.to(labels.device)), lam,
                           pairing.num_classes, dtype)
    last = images.is_contiguous(memory_format=torch.channels_last) and not images.is_contiguous()
    return mixed.contiguous(memory_format=torch.channels_last if last
                            else torch.contiguous_format), targets
