"""What the wrappers do so that a module behaves in replicas as it does alone.

A call with no tensor to split runs the module once, on the first device. A lazy module gets
one dry forward on the first chunk in the caller's thread (eval mode, no grad), so replica
threads never race to materialise it. ``zero_grad`` in a replica warns and does nothing, as in
torch; the module itself (replica 0) gets that only while the replicas run.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Sequence

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from tandem.errors import UsageError

from .scatter_gather import batch_size, scatter_kwargs

__all__ = ["split_inputs", "first_lazy", "initialise_lazy", "acting_as_replica",
           "replica_zero_grad"]


def split_inputs(inputs, kwargs, devices: Sequence[torch.device], dim: int):
    """``scatter_kwargs``, but one entry for the first device when nothing can be split.

    ``inputs=None`` means no positional inputs, as in torch.
    """
    inputs = () if inputs is None else tuple(inputs)
    if batch_size((inputs, kwargs or {}), dim) is None:  # no batch: run once, not per replica
        devices = devices[:1]
    return scatter_kwargs(inputs, kwargs, devices, dim)


def first_lazy(module: nn.Module) -> str | None:
    """The qualified name of ``module``'s first uninitialised parameter or buffer, or ``None``."""
    for name, t in module.named_parameters(remove_duplicate=False):
        if is_lazy(t):
            return name
    for name, t in module.named_buffers(remove_duplicate=False):
        if is_lazy(t):
            return name
    return None


def initialise_lazy(module: nn.Module, args, kwargs) -> None:
    """Materialise ``module``'s lazy parameters with one dry forward on ``(args, kwargs)``.

    Runs in eval mode without grad (batch-norm statistics unchanged, no dropout draws) and
    restores every submodule's training flag. Does nothing when nothing is lazy.
    """
    if first_lazy(module) is None:
        return
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        with torch.no_grad():
            module(*args, **kwargs)
    finally:
        for m, training in modes:
            m.training = training
    name = first_lazy(module)
    if name is not None:
        raise UsageError(f"lazy parameter {name!r} is still uninitialised after a forward on "
                         f"the first chunk; initialise the module before wrapping it")


def replica_zero_grad(set_to_none: bool = True) -> None:
    """``zero_grad`` of a replica (an instance attribute): warns and leaves every grad alone."""
    warnings.warn("zero_grad() in a DataParallel replica has no effect: the replicas' gradients "
                  "sum into the original module's parameters, so clear them outside the "
                  "forward (or use torch.autograd.grad there)", UserWarning, stacklevel=2)


@contextlib.contextmanager
def acting_as_replica(module: nn.Module):
    """Give ``module``'s tree the replicas' ``zero_grad`` for the duration of a parallel forward."""
    saved = []
    for m in module.modules():
        d = m.__dict__
        saved.append((d, d.get("zero_grad")))
        d["zero_grad"] = replica_zero_grad
    try:
        yield
    finally:
        for d, before in saved:
            if before is None:
                d.pop("zero_grad", None)
            else:
                d["zero_grad"] = before
