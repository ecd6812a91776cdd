"""``hybrid``: Krizhevsky's "one weird trick" — data-parallel features, model-parallel classifier.

:class:`tandem.hybrid.HybridParallel` splits a model with ``.features`` and ``.classifier``
(AlexNet, VGG): the convolutions run data-parallel over ``devices`` and the classifier's Linear
layers are split by output columns across them. Its forward equals ``model(x)``, so the update
equals ``single``'s (with ``sync_bn`` for models with batch norm in ``features``; ``buffers``
applies to the data-parallel trunk). A model without ``.features``/``.classifier`` (a ResNet)
is a one-line ``ValueError``. Optimizer state lives per shard, so a hybrid checkpoint's
optimizer resumes under ``hybrid`` only; its weights (merged by ``plain_state_dict``) load
anywhere.
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
    compile_unsupported = "its features and classifier shards would each need compiling"

    def setup(self, model: nn.Module) -> nn.Module:
        return HybridParallel(prepare_replicated(self, model), device_ids=self.devices,
                              output_device=self.device, buffers=self.buffers)
