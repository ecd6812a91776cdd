"""Put the replicas' outputs back together on one device (``gather``), with a dim per output.

``dim`` is one int, or a structure shaped like the output: an LSTM's ``(out, (h, c))`` gathers
with ``dim=(0, 1)``. Replicas whose shapes differ outside the gather dim raise naming the
output's path (``output[1][0]``). A scalar per replica becomes a vector, or, with
``scalars="refuse"`` (``DataParallel``), an error: no gather of per-chunk scalars is the whole
batch's value (a mean of chunk means is wrong for uneven chunks; a sum or a max is no mean).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from tandem.errors import UsageError

from . import traffic
from .devices import index_of
from .scatter_gather import _CudaGather, _children, _rebuild, nbytes


def _all_equal(values: Sequence) -> bool:
    first = values[0]
    for v in values[1:]:
        if v is first:
            continue
        try:
            if not bool(v == first):
                return False
        except Exception:  # ambiguous or failing comparisons (arrays, odd objects)
            return False
    return True


def _labels(obj) -> list[str]:
    """How the path to each child of the container ``obj`` is written."""
    if isinstance(obj, dict):
        return [f"[{k!r}]" for k in obj]
    if dataclasses.is_dataclass(obj):
        return [f".{f.name}" for f in dataclasses.fields(obj)]
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return [f".{name}" for name in obj._fields]
    return [f"[{i}]" for i in range(len(obj))]


def _child_dims(dim, obj, count: int, path: str) -> list:
    """The gather dim of each child of ``obj``: an int applies to all, a structure is matched."""
    if isinstance(dim, int):
        return [dim] * count
    if isinstance(dim, dict) and isinstance(obj, dict) and dim.keys() == obj.keys():
        return [dim[k] for k in obj]
    if isinstance(dim, (tuple, list)) and not isinstance(obj, dict) and len(dim) == count:
        return list(dim)
    raise UsageError(f"gather: dim {dim!r} does not match the structure of {path}")


def _check_shapes(tensors: Sequence[torch.Tensor], dim: int, path: str) -> None:
    shapes = [tuple(t.shape) for t in tensors]
    if any(len(s) != len(shapes[0]) for s in shapes):
        raise UsageError(f"gather: {path} has shapes {shapes} on the replicas, with different "
                         f"numbers of dimensions")
    for k in range(len(shapes[0])):
        if k != dim and any(s[k] != shapes[0][k] for s in shapes):
            raise UsageError(
                f"gather: cannot concatenate {path} along dim {dim}: the replicas returned "
                f"shapes {', '.join(map(str, shapes))}, which differ in dim {k}",
                hint=f"if its batch is in dim {k} (an RNN's hidden state is (layers, batch, "
                     f"features)), give {path} gather dim {k} with DataParallel(..., "
                     f"gather_dim=...) or gather(..., dim=...), or return it batch-first")


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
    d = dim + tensors[0].dim() if dim < 0 else dim
    if not 0 <= d < tensors[0].dim():
        raise UsageError(f"gather: {path} has {tensors[0].dim()} dimensions, no dim {dim}")
    _check_shapes(tensors, d, path)
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
        if first is None and all(o is None for o in outputs):
            return None
        # the same object handed to every replica comes back once; differing values as a list
        return first if _all_equal(outputs) else list(outputs)
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
    their common structure (see the module doc); differentiable.

    0-dim tensors become a vector, one entry per replica (``scalars="stack"``), or an error
    naming the output (``"refuse"``; one replica's scalar is the batch's own and passes).
    Non-tensors equal in every replica come back once, else as a list, one per replica.
    """
    outputs = list(outputs)
    if not outputs:
        raise UsageError("gather needs at least one replica output")
    if scalars not in ("stack", "refuse"):
        raise UsageError(f"gather: scalars must be 'stack' or 'refuse', not {scalars!r}")
    target = torch.device(target_device)
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    return _gather(outputs, target, dim, "output", scalars)
