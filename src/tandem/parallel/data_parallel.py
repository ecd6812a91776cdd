"""Data parallelism in one process: ``DataParallel``, ``DataParallelModel`` and ``data_parallel``.

Unlike ``torch.nn.DataParallel``: any device type, fewer replicas for a small batch, the plain
module's ``state_dict`` keys, and a scalar output (a loss) refused, not averaged per replica.
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
from .guards import initialise_lazy, split_inputs
from .scatter_gather import batch_size, gather, scatter_kwargs
from .shares import shares
from .split import BatchSplit


def _move_to(obj, device: torch.device):
    """``obj`` with its tensors on ``device`` (the same object when they already are)."""
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

    ``module`` is moved to ``device_ids[0]`` in place (an optimizer built before stays valid);
    with one device it is called directly. ``buffers``: ``"replica0"`` or ``"average"``
    (:mod:`~tandem.parallel.buffers`). ``gather_dim`` (default ``dim``): an int or one per output.
    ``split``: weights such as ``(3, 1)``, ``"auto"`` (timed forwards move them) or a strategy's
    :class:`~tandem.parallel.split.BatchSplit`; ``max_share`` caps a device's chunk; the update
    is the same whatever the shares. ``last_shares``: the last forward's chunk sizes.
    ``backward_threads``: each CPU replica's backward in its own thread (``None``: decided once,
    :func:`~tandem.parallel.threaded_backward.decide`).

    Warning: a 0-dim output from several replicas (a loss in ``forward``) is a ``UsageError``:
    no gather of per-chunk scalars is the batch's value. Return per-sample values, or use
    :class:`DataParallelModel` with :class:`~tandem.parallel.DataParallelCriterion`.
    """

    def __init__(self, module: nn.Module, device_ids: Sequence | None = None,
                 output_device=None, dim: int = 0, buffers: str = "replica0", gather_dim=None,
                 split=None, max_share: int | None = None, backward_threads: bool | None = None,
                 split_clock: Callable | None = None):
        super().__init__()
        self.buffer_policy = check_policy(buffers)
        self.device_ids = resolve_devices(device_ids)
        if isinstance(split, BatchSplit):  # a strategy's: it steps it once per optimizer step
            self.split = split
        else:
            self.split = BatchSplit(split, len(self.device_ids), max_share, clock=split_clock,
                                    steps_itself=True)
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
        devices, sizes = self.placement(inputs, kwargs)
        inputs, kwargs = self.scatter(inputs, kwargs, devices, sizes)
        devices = devices[: len(inputs)]
        initialise_lazy(self.module, inputs[0], kwargs[0])  # once, here, not in every thread
        replicas = self.replicate(self.module, devices, inputs, kwargs)
        outputs = self.parallel_apply(replicas, inputs, kwargs, devices)
        self.sync_buffers(replicas, inputs, kwargs)
        return self.gather(outputs, self.output_device)

    def weights(self) -> tuple[float, ...] | None:
        """The split's weights now (``None``: balanced chunks)."""
        return self.split.weights()

    def placement(self, inputs: tuple, kwargs: dict):
        """``(devices with samples, their chunk sizes)`` (``None``: even); sets ``last_shares``."""
        batch = batch_size((() if inputs is None else tuple(inputs), kwargs or {}), self.dim)
        sizes = None if batch is None else self.split.sizes(batch)
        if sizes is None:
            self.last_shares = None if batch is None else shares(batch, [1] * len(self.device_ids))
            return self.device_ids, None
        self.last_shares = sizes
        used = [d for d, n in zip(self.device_ids, sizes) if n]
        return used or self.device_ids[:1], [n for n in sizes if n] or [0]

    # -- the steps, so that subclasses can change one -------------------------------------------
    def scatter(self, inputs: tuple, kwargs: dict, device_ids: Sequence[torch.device],
                chunk_sizes: Sequence[int] | None = None):
        if chunk_sizes is None:
            return split_inputs(inputs, kwargs, device_ids, self.dim)
        return scatter_kwargs(inputs, kwargs, device_ids, self.dim, chunk_sizes)

    def replicate(self, module: nn.Module, device_ids: Sequence[torch.device],
                  inputs=(), kwargs=()) -> list[nn.Module]:
        """Detached replicas when this forward takes the threaded backward, else ``replicate``."""
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

    def single(self, output):  # forward's result for the module's output on one device
        return output

    def extra_repr(self) -> str:
        devices = ", ".join(str(d) for d in self.device_ids)
        split = "" if self.weights() is None else f", split={self.weights()}"
        return (f"device_ids=[{devices}], output_device={self.output_device}, "
                f"buffers={self.buffer_policy!r}{split}")


def _at_rows(runs: Sequence, inputs, kwargs, dim: int) -> list:
    """``runs`` each moved to its chunk's first row, where keyed dropout draws its masks."""
    if keyed_stream.current() is None:
        return runs
    sizes = [batch_size((a, k), dim) or 0 for a, k in zip(inputs, kwargs)]
    firsts = itertools.accumulate([0, *sizes[:-1]])
    return [_from_row(run, first) if first else run for run, first in zip(runs, firsts)]


def _from_row(module, first: int):
    """``module`` called with the keyed stream moved on to its chunk's first row."""
    def run(*args, **kwargs):
        with keyed_stream.shifted(first):
            return module(*args, **kwargs)
    return run


class DataParallelModel(DataParallel):
    """``DataParallel`` that returns the per-device outputs, for
    :class:`~tandem.parallel.DataParallelCriterion`: no output piles up on one device."""

    def gather(self, outputs: list, output_device: torch.device) -> list:
        return list(outputs)

    def single(self, output) -> list:
        return [output]


def data_parallel(module: nn.Module, inputs, device_ids: Sequence | None = None,
                  output_device=None, dim: int = 0, module_kwargs: dict | None = None,
                  gather_dim=None):
    """``module(*inputs, **module_kwargs)`` over ``device_ids``, gathered, as ``DataParallel``
    does (``inputs``: one argument or a tuple); ``module`` stays put, buffers keep replica 0's."""
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
