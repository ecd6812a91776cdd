"""tandem.parallel: the single-process parallel engine (any device type).

Layered like ``torch.nn.parallel``: scatter/gather, replicate, parallel_apply, then the
``DataParallel`` wrappers and the balanced ``DataParallelCriterion``.
"""

from .criterion import DataParallelCriterion
from .data_parallel import DataParallel, DataParallelModel, data_parallel
from .parallel_apply import parallel_apply
from .replicate import replicate
from .scatter_gather import gather, scatter, scatter_kwargs
from .sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm

__all__ = ["scatter", "scatter_kwargs", "gather", "replicate", "parallel_apply", "data_parallel",
           "DataParallel", "DataParallelModel", "DataParallelCriterion",
           "SyncBatchNorm", "convert_sync_batchnorm"]
