"""``hybrid``: data-parallel features, model-parallel classifier.

See :class:`tandem.hybrid.HybridParallel`: any model whose Linear head it finds (``classifier``,
``fc``, or the attribute ``hybrid_head`` names) and which calls that head last. Optimizer state is per classifier shard, so it
resumes under ``hybrid`` only; the weights load anywhere.
"""

from __future__ import annotations

from torch import nn

from tandem.hybrid import HybridParallel
from tandem.hybrid.layout import head_problem

from .base import register
from .dp import ReplicatedStrategy, prepare_replicated

__all__ = ["HybridStrategy"]


@register
class HybridStrategy(ReplicatedStrategy):
    name = "hybrid"
    portable_optimizer_state = False
    compile_unsupported = "its features and classifier shards would each need compiling"

    @classmethod
    def check_model(cls, model: nn.Module, hybrid_head: str | None = None) -> str | None:
        return head_problem(model, hybrid_head)

    def setup(self, model: nn.Module) -> nn.Module:
        return HybridParallel(prepare_replicated(self, model), head=self.hybrid_head,
                              **self.wrapper_options())
