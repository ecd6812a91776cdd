"""Whether a model was built on the meta device (shapes only), so that it skips its weight
initialisation: torch's ``normal_`` on a meta tensor imports ``torch._dynamo`` (about 2 s).
"""

from __future__ import annotations

from torch import nn


def on_meta(model: nn.Module) -> bool:
    """True when any of ``model``'s parameters lives on the meta device."""
    return any(p.is_meta for p in model.parameters())
