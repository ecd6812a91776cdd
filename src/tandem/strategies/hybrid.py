"""``hybrid``: data-parallel features, model-parallel classifier.

See :class:`tandem.hybrid.HybridParallel`: any model whose Linear head it finds (``classifier``,
``fc``, or the attribute ``hybrid_head`` names) and which calls that head last. Optimizer state
is saved and loaded in the plain model's layout, so runs continue across strategies.
"""

from __future__ import annotations

from torch import nn

from tandem.hybrid import HybridParallel
from tandem.hybrid.layout import head_problem

from .base import register
from .dp import ReplicatedStrategy, prepare_replicated


class SplitsHead:
    """What ``hybrid`` and ``hybrid-ddp`` share: a Linear head to split, found and checked
    alike, and the optimizer state the wrapper keeps in the plain model's layout."""

    model_options = ("hybrid_head",)  # the attribute holding the Linear head to split

    @classmethod
    def check_model(cls, model: nn.Module, hybrid_head: str | None = None, **_) -> str | None:
        return head_problem(model, hybrid_head)

    def optimizer_state_dict(self, wrapped: nn.Module, optimizer) -> dict:
        return wrapped.plain_optimizer_state(optimizer)

    def load_optimizer_state_dict(self, wrapped: nn.Module, optimizer, state: dict) -> None:
        wrapped.load_plain_optimizer_state(optimizer, state)


@register
class HybridStrategy(SplitsHead, ReplicatedStrategy):
    name = "hybrid"
    compile_unsupported = "its features and classifier shards would each need compiling"

    def plain_norms(self, wrapped: nn.Module):
        return wrapped.plain_norms()  # a split layer's shards summed

    def setup(self, model: nn.Module) -> nn.Module:
        return HybridParallel(prepare_replicated(self, model), head=self.options["hybrid_head"],
                              **self.wrapper_options())
