"""``hybrid``: Krizhevsky's "one weird trick" — data-parallel features, model-parallel classifier.

:class:`tandem.hybrid.HybridParallel` splits a model with ``.features`` and ``.classifier``
(AlexNet, VGG): the convolutions run data-parallel over ``devices`` and the classifier's Linear
layers are split by output columns across them. Its forward equals ``model(x)``, so the update
equals ``single``'s (with ``sync_bn`` for models that have batch norm in ``features``).
Checkpoints store the plain, merged model (``tandem.checkpoint`` calls ``plain_state_dict``).
"""

from __future__ import annotations

from torch import nn

from tandem.hybrid import HybridParallel

from .base import Strategy, register
from .dp import prepare_replicated

__all__ = ["HybridStrategy"]


@register
class HybridStrategy(Strategy):
    name = "hybrid"

    def setup(self, model: nn.Module) -> nn.Module:
        if not (hasattr(model, "features") and hasattr(model, "classifier")):
            raise ValueError(
                f"strategy 'hybrid' needs a model with .features and .classifier (alexnet, "
                f"vgg*); {type(model).__name__} has not; use --strategy dp or balanced"
            )
        return HybridParallel(prepare_replicated(self, model), device_ids=self.devices,
                              output_device=self.device)
