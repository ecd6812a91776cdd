"""Whether a model was built on the meta device (shapes only, no values).

Such a model skips its weight initialisation: a meta tensor has no values to set, and torch's
``normal_`` on one imports ``torch._dynamo`` (about 2 s of CPU in every process that does it;
``tandem train`` builds a meta model to plan each run, ``tandem models`` one per model).
"""

from __future__ import annotations

from torch import nn


def on_meta(model: nn.Module) -> bool:
    """True when any of ``model``'s parameters lives on the meta device."""
    return any(p.is_meta for p in model.parameters())
