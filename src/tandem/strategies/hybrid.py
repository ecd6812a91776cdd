"""``hybrid``: data-parallel features, model-parallel classifier.

See :class:`tandem.hybrid.HybridParallel`. Optimizer state is per classifier shard, so it
resumes under ``hybrid`` only; the weights load anywhere.
"""

from __future__ import annotations

from torch import nn

from tandem.hybrid import HybridParallel
from tandem.models import list_models, model_info

from .base import register
from .dp import ReplicatedStrategy, prepare_replicated

__all__ = ["HybridStrategy"]


@register
class HybridStrategy(ReplicatedStrategy):
    name = "hybrid"
    portable_optimizer_state = False
    compile_unsupported = "its features and classifier shards would each need compiling"

    @classmethod
    def check_model(cls, model: nn.Module) -> str | None:
        if hasattr(model, "features") and hasattr(model, "classifier"):
            return None
        split = [n for n in list_models() if model_info(n).family in ("alexnet", "vgg")]
        return f"needs a model with .features and .classifier: {', '.join(split)}"

    def setup(self, model: nn.Module) -> nn.Module:
        return HybridParallel(prepare_replicated(self, model), **self.wrapper_options())
