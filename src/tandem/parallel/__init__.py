"""tandem.parallel: the single-process parallel engine (any device type).

Layers, each in its own file: ``scatter_gather`` and ``gather_outputs`` (split and rebuild
batches), ``replicate`` (cached, autograd-connected module replicas), ``parallel_apply`` (one
thread per replica), ``guards`` (lazy modules, zero-input calls, ``zero_grad`` in replicas),
``buffers`` (what happens to replicas' running statistics), ``data_parallel`` (the wrappers)
and ``criterion`` (the balanced loss).
"""

from .criterion import DataParallelCriterion
from .data_parallel import DataParallel, DataParallelModel, data_parallel
from .gather_outputs import gather
from .parallel_apply import parallel_apply
from .replicate import replicate
from .scatter_gather import scatter, scatter_kwargs
from .sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm

__all__ = [
    "scatter", "scatter_kwargs", "gather", "replicate", "parallel_apply", "data_parallel",
    "DataParallel", "DataParallelModel", "DataParallelCriterion",
    "SyncBatchNorm", "convert_sync_batchnorm",
]
