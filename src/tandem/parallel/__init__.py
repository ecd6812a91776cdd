"""tandem.parallel: the single-process parallel engine (any device type).

Layers, each in its own file: ``scatter_gather`` (split and rebuild batches), ``replicate``
(cached, autograd-connected module replicas), ``parallel_apply`` (one thread per replica),
``data_parallel`` (the wrappers), ``criterion`` (the balanced loss) and ``buffers`` (what
happens to replicas' running statistics).
"""

from .scatter_gather import gather, scatter, scatter_kwargs

__all__ = ["scatter", "scatter_kwargs", "gather"]
