"""Split a batch across replicas (``scatter``) and put their outputs back together (``gather``).

Tuples, lists, dicts, namedtuples and dataclasses are walked; tensors split along ``dim``, other
objects go to every replica as they are. Chunks are balanced, larger first, never empty (2 over
4 devices gives 2). ``gather``'s ``dim`` is an int or one per output (an LSTM's ``(out, (h,
c))``: ``(0, 1)``). Differentiable; bytes moved are reported to :mod:`tandem.parallel.traffic`.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Sequence

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
        ctx.dim, ctx.devices = dim, [t.device for t in inputs]
        ctx.sizes = [t.shape[dim] for t in inputs]
        return comm.gather(inputs, dim, cuda_index(target))

    @staticmethod
    def backward(ctx, grad):
        return (None, None) + _CudaScatter.apply(ctx.devices, ctx.sizes, ctx.dim, grad)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _split_dim(t: torch.Tensor, dim: int) -> int | None:  # None: too few dims to split
    d = dim + t.dim() if dim < 0 else dim
    return d if 0 <= d < t.dim() else None


def _children(obj) -> list | None:  # None: not a container _rebuild knows
    if isinstance(obj, (tuple, list)):
        return list(obj)
    if isinstance(obj, dict):
        return list(obj.values())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    return None


def _rebuild(obj, items: list):
    """A container like ``obj`` holding ``items`` instead of its own items."""
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*items)
    if isinstance(obj, (tuple, list)):
        return type(obj)(items)
    if isinstance(obj, dict):
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
    return obj if items is None else _rebuild(obj, [map_tensors(item, fn) for item in items])


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


def _batch_sizes(obj, dim: int):
    return (t.shape[d] for t in tensors_in(obj) if (d := _split_dim(t, dim)) is not None)


def batch_size(obj, dim: int = 0) -> int | None:
    """Size along ``dim`` of the first splittable tensor in ``obj``, or ``None``."""
    return next(_batch_sizes(obj, dim), None)


def _scatter_tensor(t: torch.Tensor, devices, dim, sizes) -> list[torch.Tensor]:
    d = _split_dim(t, dim)
    if d is None:  # nothing to split: every replica gets its own copy of the whole tensor
        chunks = [t.to(dev) for dev in devices]
    else:
        if sizes is None:  # scatter trimmed devices so that this never gives an empty chunk
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
    per_item = [_scatter(item, devices, dim, sizes) for item in items]
    columns = zip(*per_item) if items else [()] * len(devices)  # an empty container: one each
    return [_rebuild(obj, list(replica_items)) for replica_items in columns]


def scatter(inputs, devices: Sequence, dim: int = 0,
            chunk_sizes: Sequence[int] | None = None) -> list:
    """Split ``inputs`` into one structure like it per *used* device; ``chunk_sizes`` forces
    the split (every splittable tensor must have their sum along ``dim``)."""
    devices = [torch.device(d) for d in devices]
    if not devices:
        raise UsageError("scatter needs at least one device")
    found = list(_batch_sizes(inputs, dim))
    if chunk_sizes is None:  # no replica gets an empty chunk
        used = devices[:max(1, min(min(found), len(devices)))] if found else devices
        return _scatter(inputs, used, dim, None)
    sizes = list(chunk_sizes)
    if len(sizes) > len(devices) or any(s < 0 for s in sizes):
        raise UsageError(f"chunk_sizes {sizes} do not fit {len(devices)} device(s)")
    for b in found:
        if b != sum(sizes):
            raise UsageError(f"cannot scatter a tensor with {b} entries along dim {dim} into "
                             f"chunks {sizes}")
    return _scatter(inputs, devices[: len(sizes)], dim, sizes)


def scatter_kwargs(inputs, kwargs, devices: Sequence, dim: int = 0,
                   chunk_sizes: Sequence[int] | None = None) -> tuple[tuple, tuple]:
    """Scatter ``inputs`` and ``kwargs`` together: per-replica argument tuples and kwargs dicts."""
    pairs = scatter((() if inputs is None else tuple(inputs), dict(kwargs or {})), devices, dim,
                    chunk_sizes)
    return tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)


def _labels(obj) -> list[str]:  # each child's step in an output's path
    if isinstance(obj, dict):
        return [f"[{k!r}]" for k in obj]
    if dataclasses.is_dataclass(obj):
        return [f".{f.name}" for f in dataclasses.fields(obj)]
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return [f".{name}" for name in obj._fields]
    return [f"[{i}]" for i in range(len(obj))]


def _child_dims(dim, obj, count: int, path: str) -> list:  # an int applies to all children
    if isinstance(dim, int):
        return [dim] * count
    if isinstance(dim, dict) and isinstance(obj, dict) and dim.keys() == obj.keys():
        return [dim[k] for k in obj]
    if isinstance(dim, (tuple, list)) and not isinstance(obj, dict) and len(dim) == count:
        return list(dim)
    raise UsageError(f"gather: dim {dim!r} does not match the structure of {path}")


def _gather_tensors(tensors: Sequence[torch.Tensor], target: torch.device, dim, path: str,
                    scalars: str):
    if not isinstance(dim, int):
        raise UsageError(f"gather: {path} is a tensor, so its dim must be an int, not {dim!r}")
    if all(t.dim() == 0 for t in tensors):
        if scalars == "refuse":
            if len(tensors) > 1:
                raise UsageError(
                    f"DataParallel: {path} is a scalar on each of the {len(tensors)} replicas, "
                    f"and no gather of per-chunk scalars is the whole batch's value",
                    hint="return one value per sample (e.g. reduction='none') and reduce after "
                         "DataParallel, or compute the loss with DataParallelModel + "
                         "DataParallelCriterion, which is exact for uneven chunks")
            return tensors[0].to(target)  # one chunk: its scalar is the whole batch's
        tensors, dim = [t.reshape(1) for t in tensors], 0  # scalars become a vector
    d = _split_dim(tensors[0], dim)
    if d is None:
        raise UsageError(f"gather: {path} has {tensors[0].dim()} dimensions, no dim {dim}")
    shapes = [tuple(t.shape) for t in tensors]
    if any(len(s) != len(shapes[0]) for s in shapes):
        raise UsageError(f"gather: {path} has shapes {shapes} on the replicas, with different "
                         f"numbers of dimensions")
    for k in range(len(shapes[0])):
        if k != d and any(s[k] != shapes[0][k] for s in shapes):
            raise UsageError(
                f"gather: cannot concatenate {path} along dim {d}: the replicas returned "
                f"shapes {', '.join(map(str, shapes))}, which differ in dim {k}",
                hint=f"if its batch is in dim {k} (an RNN's hidden state is (layers, batch, "
                     f"features)), give {path} gather dim {k} with DataParallel(..., "
                     f"gather_dim=...) or gather(..., dim=...), or return it batch-first")
    if traffic.metering():
        home = index_of(target, [t.device for t in tensors])
        for i, t in enumerate(tensors):
            if i != home:
                traffic.record("gather", nbytes(t), home)
    if target.type == "cuda" and all(t.device.type == "cuda" for t in tensors):
        return _CudaGather.apply(target, d, *tensors)
    if len(tensors) == 1:
        return tensors[0].to(target)
    return torch.cat([t.to(target) for t in tensors], d)


def _gather(outputs: list, target: torch.device, dim, path: str, scalars: str) -> Any:
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        if not all(isinstance(o, torch.Tensor) for o in outputs):
            raise UsageError(f"gather: replicas returned a tensor at {path} in some entries "
                             f"and not in others")
        return _gather_tensors(outputs, target, dim, path, scalars)
    items = _children(first)
    if items is None:
        try:  # the same object (None too) handed to every replica comes back once, else a list
            same = all(o is first or bool(o == first) for o in outputs[1:])
        except Exception:  # ambiguous or failing comparisons (arrays, odd objects)
            same = False
        return first if same else list(outputs)
    per_replica = []
    for i, o in enumerate(outputs):
        if type(o) is not type(first):
            raise UsageError(f"gather: replica {i} returned {type(o).__name__} at {path}, "
                             f"replica 0 {type(first).__name__}")
        if isinstance(o, dict) and o.keys() != first.keys():
            raise UsageError(f"gather: replica {i} returned keys {list(o)} at {path}, "
                             f"replica 0 {list(first)}")
        children = _children(o)
        if len(children) != len(items):
            raise UsageError(f"gather: replica {i} returned {len(children)} items at {path}, "
                             f"replica 0 {len(items)}")
        per_replica.append(children)
    dims = _child_dims(dim, first, len(items), path)
    gathered = [_gather(list(column), target, d, path + label, scalars)
                for column, d, label in zip(zip(*per_replica), dims, _labels(first))]
    return _rebuild(first, gathered)


def gather(outputs: Sequence, target_device, dim=0, *, scalars: str = "stack"):
    """Concatenate the replicas' ``outputs`` along ``dim`` on ``target_device``, rebuilding
    their structure. 0-dim tensors become a vector (``scalars="stack"``) or an error (``"refuse"``:
    one replica's passes). Other values equal in every replica come back once, else as a list."""
    outputs = list(outputs)
    if not outputs:
        raise UsageError("gather needs at least one replica output")
    if scalars not in ("stack", "refuse"):
        raise UsageError(f"gather: scalars must be 'stack' or 'refuse', not {scalars!r}")
    target = torch.device(target_device)
    target = torch.device("cuda", cuda_index(target)) if target.type == "cuda" else target
    return _gather(outputs, target, dim, "output", scalars)
