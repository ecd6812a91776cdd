"""``single``: the whole global batch on one device — the reference every strategy must match."""

from __future__ import annotations

import warnings

import torch

from tandem.errors import UsageError

from .base import Strategy, register


@register
class SingleDevice(Strategy):
    """Train on ``devices[0]``; other devices given are ignored, with a warning."""

    name = "single"
    max_devices = 1
    reference = True

    def __init__(self, devices: list[torch.device], **kwargs):
        if not devices:
            raise UsageError("strategy 'single' needs a device")
        if len(devices) > 1:
            warnings.warn(
                f"strategy 'single' uses only {devices[0]} of the {len(devices)} devices given; "
                "use --strategy dp, balanced or hybrid to use them all", stacklevel=2)
        super().__init__(devices[:1], **kwargs)
