"""Precision and memory-layout variants of every contestant, raced in one interleaved run.

``--variants fp32,cl,amp,amp+cl`` gives each contestant up to four twins, named by suffix:
``single`` (float32, contiguous), ``single+cl`` (channels-last), ``single+amp`` (``--amp``,
see :mod:`tandem.precision`) and ``single+amp+cl``; a ``+compile`` twin of each follows it.
Without ``--variants`` every contestant runs as ``--amp``/``--channels-last`` say, unsuffixed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.distributed.env import Environment, cpu_bf16_override
from tandem.precision import Precision, amp_precision

VARIANTS = ("fp32", "cl", "amp", "amp+cl")


@dataclass(frozen=True)
class Variant:
    """``amp``: autocast as ``--amp`` means on the device; ``channels_last``: NHWC model and
    inputs; ``suffix``: what the contestant's name gets (``""`` for the only variant)."""

    amp: bool = False
    channels_last: bool = False
    suffix: str = ""

    @classmethod
    def named(cls, name: str) -> "Variant":
        """The variant of a ``--variants`` entry (one of :data:`VARIANTS`)."""
        parts = set(name.split("+"))
        return cls("amp" in parts, "cl" in parts, "" if name == "fp32" else "+" + name)

    def precision(self, device: torch.device, amp_dtype: str | None) -> Precision:
        return amp_precision(device.type, self.amp, amp_dtype, cpu_bf16=cpu_bf16_override(Environment.read()))


def variants_of(config) -> list[Variant]:
    """The variants a :class:`~tandem_bench.options.BenchConfig` races, in table order."""
    if config.variants is None:
        return [Variant(config.amp, config.channels_last)]
    return [Variant.named(n) for n in config.variants]

