"""tandem.hybrid: data-parallel features, model-parallel classifier ("one weird trick").

* :class:`HybridParallel`: wraps a model with ``.features`` and ``.classifier``; features run
  data-parallel, the classifier's Linear layers are split over the devices.
* :class:`ColumnParallelLinear` / :class:`RowParallelLinear`: a Linear split by output / input
  features over devices; :class:`Shardwise` applies elementwise layers to the split blocks.
* :class:`GroupParallelConv2d`: a grouped conv with its groups on different devices.
* :func:`plan` (also ``HybridParallel.plan``): parameters, MACs and bytes moved per step,
  hybrid versus data parallel, as a :class:`HybridPlan` with a text ``report()``.
"""

from .column_linear import ColumnParallelLinear, RowParallelLinear, Shardwise
from .group_conv import GroupParallelConv2d
from .hybrid import HybridParallel
from .plan import HybridPlan, plan

__all__ = ["HybridParallel", "ColumnParallelLinear", "RowParallelLinear", "Shardwise",
           "GroupParallelConv2d", "HybridPlan", "plan"]
