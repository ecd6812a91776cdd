"""tandem.hybrid: data-parallel features, model-parallel classifier ("one weird trick").

* :class:`ColumnParallelLinear` / :class:`RowParallelLinear`: a Linear split by output / input
  features over devices; :class:`Shardwise` applies elementwise layers to the split blocks.
* :class:`GroupParallelConv2d`: a grouped conv with its groups on different devices.
"""

from .column_linear import ColumnParallelLinear, RowParallelLinear, Shardwise
from .group_conv import GroupParallelConv2d

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "Shardwise", "GroupParallelConv2d"]
