"""tandem.hybrid: data-parallel features, model-parallel classifier ("one weird trick").

:class:`HybridParallel` wraps a model with ``.features`` and ``.classifier``; the split layers
(:class:`ColumnParallelLinear`, :class:`RowParallelLinear`, :class:`GroupParallelConv2d`) and
the static cost report :func:`plan` are usable on their own.
"""

from .column_linear import ColumnParallelLinear, RowParallelLinear, Shardwise
from .cost import HybridPlan, plan
from .group_conv import GroupParallelConv2d
from .wrapper import HybridParallel

__all__ = ["HybridParallel", "ColumnParallelLinear", "RowParallelLinear", "Shardwise",
           "GroupParallelConv2d", "HybridPlan", "plan"]
