"""Data parallelism in one process: ``DataParallel``, ``DataParallelModel`` and ``data_parallel``.

A step scatters the batch, replicates the module (cached across steps), runs the replicas in
threads, applies the buffer policy and gathers the outputs, so one optimizer on
``module.parameters()`` sees the update of one device on the whole batch (batch norm aside:
without ``SyncBatchNorm`` each replica normalises with its own chunk). Unlike
``torch.nn.DataParallel`` it runs on any device type, uses fewer replicas for a small batch,
its ``state_dict`` has the plain module's keys, and a model that returns a scalar (a loss) is
refused where torch returns one value per replica, whose mean is wrong for uneven chunks.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Sequence

import torch
from torch import nn

from tandem.keyed import stream as keyed_stream
from tandem.state_keys import register_plain_keys

from .buffers import check_policy, sync_buffers
from .devices import resolve_devices, as_device
from .parallel_apply import parallel_apply
from .replicate import replicate
from . import threaded_backward
from .gather_outputs import gather
from .guards import initialise_lazy, split_inputs
from .scatter_gather import batch_size, scatter_kwargs
from .shares import shares
from .split import BatchSplit

__all__ = ["DataParallel", "DataParallelModel", "data_parallel"]


def _move_to(obj, device: torch.device):
    """``obj`` with its tensors on ``device``; the same object when they already are."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.device == device else obj.to(device)
    if isinstance(obj, (tuple, list)) and not hasattr(obj, "_fields"):
        moved = [_move_to(x, device) for x in obj]
        if all(a is b for a, b in zip(moved, obj)):
            return obj
        return type(obj)(moved) if type(obj) in (tuple, list) else moved
    if type(obj) is dict:
        moved = {k: _move_to(v, device) for k, v in obj.items()}
        return obj if all(moved[k] is obj[k] for k in obj) else moved
    return obj


class DataParallel(nn.Module):
    """Run ``module`` on chunks of the batch on several devices and gather the outputs.

    ``device_ids``: see :mod:`tandem.parallel.devices`. ``output_device`` (default
    ``device_ids[0]``) receives the outputs. ``buffers``: ``"replica0"`` or ``"average"``
    (:mod:`tandem.parallel.buffers`). ``gather_dim`` (default ``dim``): an int, or one per
    output, e.g. ``(0, 1)`` for an LSTM. ``module`` is moved to ``device_ids[0]`` in place (an
    optimizer built before stays valid); with one device it is called directly.

    Warning: a scalar output from several replicas (a 0-dim tensor anywhere in the output,
    such as a loss computed in ``forward``) is a ``UsageError`` naming it, because no gather of
    per-chunk scalars is the whole batch's value (a mean is exact only weighted by chunk
    sizes, a sum never): return per-sample values, or use :class:`DataParallelModel` +
    :class:`~tandem.parallel.DataParallelCriterion`. One device, or a batch of one chunk,
    returns the scalar itself.

    ``split`` sets each device's share of a batch: weights such as ``(3, 1)`` (see
    :mod:`tandem.parallel.split`; a device may get none), or ``"auto"``, which times each
    replica's forward in training and moves the weights toward the speeds before the next
    forward (read then, a CUDA device's time waits for no work still running).
    ``max_share`` caps any device's chunk. Both end up in ``self.split``, a
    :class:`~tandem.parallel.split.BatchSplit`; a strategy passes its own as ``split`` and
    steps it once per optimizer step. The update is the same whatever the shares.
    ``split_clock``: a test clock for ``"auto"``
    (:func:`~tandem.parallel.split.clock_from_spec`; default: real time).
    ``last_shares`` holds the chunk sizes of the last forward, one per device.

    ``backward_threads``: ``True`` runs each CPU replica's backward in its own thread instead
    of all in autograd's one CPU thread (:mod:`tandem.parallel.threaded_backward`; same
    gradients, no double backward); ``False`` never; ``None`` (default) decides here, once,
    with :func:`~tandem.parallel.threaded_backward.decide`: threads when they add cores
    (fewer intra-op threads now than CPU replicas) or with a ``split``, whose shares can
    finish together only if each replica's backward runs beside the others. The decision is
    kept in ``self.backward_threads``; a later ``torch.set_num_threads`` does not change it.
    """

    def __init__(self, module: nn.Module, device_ids: Sequence | None = None,
                 output_device=None, dim: int = 0, buffers: str = "replica0", gather_dim=None,
                 split=None, max_share: int | None = None, backward_threads: bool | None = None,
                 split_clock: Callable | None = None):
        super().__init__()
        self.buffer_policy = check_policy(buffers)
        self.device_ids = resolve_devices(device_ids)
        n = len(self.device_ids)
        if isinstance(split, BatchSplit):  # a strategy's: it steps it once per optimizer step
            self.split = split
        else:
            self.split = BatchSplit(split, n, max_share, clock=split_clock, steps_itself=True)
            self.split.check_weights("split")
        self.backward_threads = threaded_backward.decide(
            self.device_ids, backward_threads, split=self.split.weights() is not None)
        self.last_shares: list[int] | None = None
        self.output_device = self.device_ids[0] if output_device is None else as_device(output_device)
        self.dim = dim
        self.gather_dim = dim if gather_dim is None else gather_dim
        self.module = module.to(self.device_ids[0])
        register_plain_keys(self, "module")

    def forward(self, *inputs: Any, **kwargs: Any):
        if len(self.device_ids) == 1:  # one device: the module itself, nothing in between
            home = self.device_ids[0]
            return self.single(self.module(*_move_to(inputs, home), **_move_to(kwargs, home)))
        # (B, ...) -> chunks of the split's shares (default about B/n) on the devices used
        devices, sizes = self.placement(inputs, kwargs)
        inputs, kwargs = self.scatter(inputs, kwargs, devices, sizes)
        devices = devices[: len(inputs)]
        initialise_lazy(self.module, inputs[0], kwargs[0])  # once, here, not in every thread
        replicas = self.replicate(self.module, devices, inputs, kwargs)
        outputs = self.parallel_apply(replicas, inputs, kwargs, devices)
        self.sync_buffers(replicas, inputs, kwargs)
        # n outputs of about B/n each -> one output of B on output_device
        return self.gather(outputs, self.output_device)

    def weights(self) -> tuple[float, ...] | None:
        """The split's weights now (``None``: balanced chunks)."""
        return self.split.weights()

    def placement(self, inputs: tuple, kwargs: dict):
        """``(devices, chunk_sizes)``: the devices with samples and their chunk sizes
        (``None``: balanced), also kept as ``last_shares`` (one per device)."""
        batch = batch_size((() if inputs is None else tuple(inputs), kwargs or {}), self.dim)
        sizes = None if batch is None else self.split.sizes(batch)
        if sizes is None:
            self.last_shares = None if batch is None else shares(batch, [1] * len(self.device_ids))
            return self.device_ids, None
        self.last_shares = sizes
        used = [d for d, n in zip(self.device_ids, sizes) if n]
        return used or self.device_ids[:1], [n for n in sizes if n] or [0]

    # -- the steps, one line each, so that subclasses can change one ---------------------------
    def scatter(self, inputs: tuple, kwargs: dict, device_ids: Sequence[torch.device],
                chunk_sizes: Sequence[int] | None = None):
        if chunk_sizes is None:
            return split_inputs(inputs, kwargs, device_ids, self.dim)
        return scatter_kwargs(inputs, kwargs, device_ids, self.dim, chunk_sizes)

    def replicate(self, module: nn.Module, device_ids: Sequence[torch.device],
                  inputs=(), kwargs=()) -> list[nn.Module]:
        """Detached replicas that run their own backward when the chunks ``inputs`` and
        ``kwargs`` take that path (:func:`~tandem.parallel.threaded_backward.applies`)."""
        if threaded_backward.applies(device_ids, inputs, kwargs, self.backward_threads):
            return threaded_backward.Replicas(module, device_ids)
        return replicate(module, device_ids)

    def parallel_apply(self, replicas, inputs, kwargs, device_ids) -> list:
        runs = self.split.timed(replicas, device_ids, self.last_shares, self.training)
        runs = _at_rows(runs, inputs, kwargs, self.dim)  # keyed dropout: each its own rows
        if isinstance(replicas, threaded_backward.Replicas):
            return threaded_backward.apply(runs, replicas.leaves, inputs, kwargs, device_ids)
        return parallel_apply(runs, inputs, kwargs, device_ids)

    def sync_buffers(self, replicas: Sequence[nn.Module], inputs, kwargs) -> None:
        sizes = [batch_size((a, k), self.dim) or 1 for a, k in zip(inputs, kwargs)]
        sync_buffers(self.module, replicas, sizes, self.buffer_policy)

    def gather(self, outputs: list, output_device: torch.device):
        return gather(outputs, output_device, dim=self.gather_dim, scalars="refuse")

    def single(self, output):
        """What ``forward`` returns for the module's output when there is one device."""
        return output

    def extra_repr(self) -> str:
        devices = ", ".join(str(d) for d in self.device_ids)
        split = "" if self.weights() is None else f", split={self.weights()}"
        return (f"device_ids=[{devices}], output_device={self.output_device}, "
                f"buffers={self.buffer_policy!r}{split}")


def _at_rows(runs: Sequence, inputs, kwargs, dim: int) -> list:
    """``runs`` (one per chunk of ``inputs``/``kwargs``), each placed at its chunk's first
    row of the caller's rows, where keyed dropout draws its masks (:mod:`tandem.keyed`); as
    they are outside a keyed stream."""
    if keyed_stream.current() is None:
        return runs
    sizes = [batch_size((a, k), dim) or 0 for a, k in zip(inputs, kwargs)]
    firsts = itertools.accumulate([0, *sizes[:-1]])
    return [_FromRow(run, first) if first else run for run, first in zip(runs, firsts)]


class _FromRow:
    """Call a replica with the keyed stream moved on to its chunk's first row."""

    def __init__(self, module, first: int):
        self.module, self.first = module, first

    def __call__(self, *args, **kwargs):
        with keyed_stream.shifted(self.first):
            return self.module(*args, **kwargs)


class DataParallelModel(DataParallel):
    """``DataParallel`` that returns the list of per-device outputs instead of gathering them.

    Pair it with :class:`~tandem.parallel.DataParallelCriterion`, which computes each
    device's share of the loss where its output lives, so outputs never pile up on one device.
    """

    def gather(self, outputs: list, output_device: torch.device) -> list:
        return list(outputs)

    def single(self, output) -> list:
        return [output]


def data_parallel(module: nn.Module, inputs, device_ids: Sequence | None = None,
                  output_device=None, dim: int = 0, module_kwargs: dict | None = None,
                  gather_dim=None):
    """Evaluate ``module(*inputs, **module_kwargs)`` in parallel over ``device_ids`` and gather.

    ``inputs`` is one argument, a tuple of them, or ``None`` (no inputs: one run on the first
    device). ``module`` stays where it is (replicas are copied to devices it is not on);
    buffers keep replica 0's updates. ``gather_dim`` and the refusal of scalar outputs are as
    for ``DataParallel``.
    """
    if inputs is not None and not isinstance(inputs, tuple):
        inputs = (inputs,)
    devices = resolve_devices(device_ids)
    output_device = devices[0] if output_device is None else as_device(output_device)
    inputs, kwargs = split_inputs(inputs, module_kwargs, devices, dim)
    used = devices[: len(inputs)]
    initialise_lazy(module, inputs[0], kwargs[0])
    replicas = replicate(module, used)
    outputs = parallel_apply(_at_rows(replicas, inputs, kwargs, dim), inputs, kwargs, used)
    sync_buffers(module, replicas, [1] * len(replicas), "replica0")
    return gather(outputs, output_device, dim if gather_dim is None else gather_dim,
                  scalars="refuse")
