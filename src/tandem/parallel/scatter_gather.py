"""Split a batch across replicas (``scatter``); the structure walking that ``gather`` shares.

Nested tuples, lists, dicts, namedtuples and dataclasses are walked; tensors are split along
``dim``, other objects go to every replica as they are (not copied). Chunks are balanced, larger
first (10 over 4: 3, 3, 2, 2), and none is empty: a batch of 2 over 4 devices gives 2 entries.
Differentiable; bytes moved are reported to :mod:`tandem.parallel.traffic`.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Sequence

import torch
import torch.cuda.comm as comm  # a submodule: not loaded by ``import torch``

from tandem.errors import UsageError

from . import traffic
from .devices import cuda_index, index_of
from .shares import shares


class _CudaScatter(torch.autograd.Function):
    """Split ``input`` (CPU or CUDA) onto CUDA devices with one ``comm.scatter`` call."""

    @staticmethod
    def forward(ctx, devices, sizes, dim, input):
        ctx.dim, ctx.source = dim, input.device
        return tuple(comm.scatter(input, [cuda_index(d) for d in devices], sizes, dim))

    @staticmethod
    def backward(ctx, *grads):
        if ctx.source.type == "cuda":
            grad = _CudaGather.apply(ctx.source, ctx.dim, *grads)
        else:
            grad = torch.cat([g.to(ctx.source) for g in grads], ctx.dim)
        return None, None, None, grad


class _CudaGather(torch.autograd.Function):
    """Concatenate CUDA tensors on one CUDA device with one ``comm.gather`` call."""

    @staticmethod
    def forward(ctx, target, dim, *inputs):
        ctx.dim = dim
        ctx.devices = [t.device for t in inputs]
        ctx.sizes = [t.shape[dim] for t in inputs]
        return comm.gather(inputs, dim, cuda_index(target))

    @staticmethod
    def backward(ctx, grad):
        return (None, None) + _CudaScatter.apply(ctx.devices, ctx.sizes, ctx.dim, grad)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _split_dim(t: torch.Tensor, dim: int) -> int | None:
    """``dim`` normalised for ``t``, or ``None`` when ``t`` has too few dimensions to split."""
    d = dim + t.dim() if dim < 0 else dim
    return d if 0 <= d < t.dim() else None


def _children(obj) -> list | None:
    """The items of a container ``_rebuild`` knows how to rebuild, else ``None``."""
    if isinstance(obj, (tuple, list)):
        return list(obj)
    if isinstance(obj, dict):
        return list(obj.values())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    return None


def _rebuild(obj, items: list):
    """A container like ``obj`` holding ``items`` instead of its own items."""
    if isinstance(obj, tuple):
        if hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*items)
        return tuple(items) if type(obj) is tuple else type(obj)(items)
    if isinstance(obj, list):
        return items if type(obj) is list else type(obj)(items)
    if isinstance(obj, dict):
        if type(obj) is dict:
            return dict(zip(obj.keys(), items))
        out = copy.copy(obj)  # keeps OrderedDict order, defaultdict's factory, ...
        out.update(zip(obj.keys(), items))
        return out
    out = copy.copy(obj)  # dataclass: object.__setattr__ also works for frozen ones
    for f, value in zip(dataclasses.fields(obj), items):
        object.__setattr__(out, f.name, value)
    return out


def map_tensors(obj, fn):
    """``obj`` with every tensor ``t`` in it replaced by ``fn(t)``, the containers rebuilt."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    items = _children(obj)
    if items is None:
        return obj
    return _rebuild(obj, [map_tensors(item, fn) for item in items])


def tensors_in(obj):
    """Every tensor in ``obj``, in the order :func:`map_tensors` visits them."""
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    for item in _children(obj) or ():
        yield from tensors_in(item)


def first_tensor(obj) -> torch.Tensor | None:
    """The first tensor in ``obj`` (a tensor or a nested structure), or ``None``."""
    return next(tensors_in(obj), None)


def _batch_sizes(obj, dim: int) -> list[int]:
    return [t.shape[d] for t in tensors_in(obj) if (d := _split_dim(t, dim)) is not None]


def batch_size(obj, dim: int = 0) -> int | None:
    """Size along ``dim`` of the first splittable tensor in ``obj``, or ``None``."""
    return next((t.shape[d] for t in tensors_in(obj) if (d := _split_dim(t, dim)) is not None),
                None)


def _scatter_tensor(t: torch.Tensor, devices, dim, sizes) -> list[torch.Tensor]:
    d = _split_dim(t, dim)
    if d is None:  # nothing to split: every replica gets its own copy of the whole tensor
        chunks = [t.to(dev) for dev in devices]
    else:
        if sizes is None:  # _plan trimmed devices so that this never gives an empty chunk
            sizes = shares(t.shape[d], [1] * len(devices))
        if t.device.type in ("cuda", "cpu") and all(dev.type == "cuda" for dev in devices):
            chunks = list(_CudaScatter.apply(devices, sizes, d, t))
        else:
            chunks = [c.to(dev) for c, dev in zip(t.split(sizes, d), devices)]
    if traffic.metering():
        home = index_of(t.device, devices)
        for i, chunk in enumerate(chunks):
            if i != home:
                traffic.record("scatter", nbytes(chunk), i)
    return chunks


def _scatter(obj, devices, dim, sizes) -> list:
    if isinstance(obj, torch.Tensor):
        return _scatter_tensor(obj, devices, dim, sizes)
    items = _children(obj)
    if items is None:
        return [obj] * len(devices)
    if not items:
        return [_rebuild(obj, []) for _ in devices]
    per_item = [_scatter(item, devices, dim, sizes) for item in items]
    return [_rebuild(obj, list(replica_items)) for replica_items in zip(*per_item)]


def _plan(obj, devices: Sequence, dim: int, sizes: Sequence[int] | None) -> tuple[list, list | None]:
    """The devices used and the chunk sizes to aim for (``None``: balanced)."""
    devices = [torch.device(d) for d in devices]
    if not devices:
        raise UsageError("scatter needs at least one device")
    found = _batch_sizes(obj, dim)
    if sizes is None:  # no replica gets an empty chunk
        return (devices[:max(1, min(min(found), len(devices)))] if found else devices), None
    sizes = list(sizes)
    if len(sizes) > len(devices) or any(s < 0 for s in sizes):
        raise UsageError(f"chunk_sizes {sizes} do not fit {len(devices)} device(s)")
    for b in found:
        if b != sum(sizes):
            raise UsageError(f"cannot scatter a tensor with {b} entries along dim {dim} into "
                             f"chunks {sizes}")
    return devices[: len(sizes)], sizes


def scatter(inputs, devices: Sequence, dim: int = 0, chunk_sizes: Sequence[int] | None = None) -> list:
    """Split ``inputs`` into one structure like it per *used* device (see the module doc).

    ``chunk_sizes`` forces the split: every splittable tensor must have ``sum(chunk_sizes)``
    entries along ``dim``.
    """
    used, sizes = _plan(inputs, devices, dim, chunk_sizes)
    return _scatter(inputs, used, dim, sizes)


def scatter_kwargs(inputs, kwargs, devices: Sequence, dim: int = 0,
                   chunk_sizes: Sequence[int] | None = None) -> tuple[tuple, tuple]:
    """Scatter positional ``inputs`` and ``kwargs`` together: ``(inputs_list, kwargs_list)``,
    per-replica argument tuples and keyword dicts, of equal length."""
    inputs = tuple(inputs) if inputs is not None else ()
    kwargs = dict(kwargs) if kwargs else {}
    pairs = scatter((inputs, kwargs), devices, dim, chunk_sizes)
    return tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)
