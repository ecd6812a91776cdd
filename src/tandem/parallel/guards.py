"""What the wrappers do so that a module behaves in replicas as it does alone.

A call with no tensor to split runs once, on the first device. A lazy module gets one dry
forward in the caller's thread, so replica threads never race to materialise it. ``zero_grad``
in a replica warns and does nothing, as in torch, replica 0 (the module itself) included.
"""

from __future__ import annotations

import itertools
import warnings
import weakref
from typing import Sequence

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from tandem.errors import UsageError

from .context import current
from .scatter_gather import batch_size, scatter_kwargs


def split_inputs(inputs, kwargs, devices: Sequence[torch.device], dim: int):
    """``scatter_kwargs``, but one entry for the first device when nothing can be split
    (``inputs=None``: no positional inputs, as in torch)."""
    inputs = () if inputs is None else tuple(inputs)
    if batch_size((inputs, kwargs or {}), dim) is None:  # no batch: run once, not per replica
        devices = devices[:1]
    return scatter_kwargs(inputs, kwargs, devices, dim)


def first_lazy(module: nn.Module) -> str | None:
    """The qualified name of ``module``'s first uninitialised parameter or buffer, or ``None``."""
    named = itertools.chain(module.named_parameters(remove_duplicate=False),
                            module.named_buffers(remove_duplicate=False))
    return next((name for name, t in named if is_lazy(t)), None)


def initialise_lazy(module: nn.Module, args, kwargs) -> None:
    """Materialise lazy parameters with one forward on ``(args, kwargs)`` in eval mode without
    grad (running stats unchanged, no dropout draws), training flags restored."""
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
                         f"the first chunk", hint="initialise the module before wrapping it")


class ReplicaZeroGrad:
    """A ``zero_grad`` that warns and does nothing in a replica thread, else is the module's
    (replica 0 is the module itself). Held weakly: no cycle through the module's ``__dict__``."""

    __slots__ = ("_module",)

    def __init__(self, module: nn.Module):
        self._module = weakref.ref(module)

    def __call__(self, set_to_none: bool = True) -> None:
        if current() is not None:
            warnings.warn("zero_grad() in a DataParallel replica has no effect (the gradients "
                          "sum into the module's own): clear them outside the forward",
                          UserWarning, stacklevel=2)
            return
        module = self._module()
        type(module).zero_grad(module, set_to_none)

    def __deepcopy__(self, memo):
        module = self._module()
        return ReplicaZeroGrad(memo.get(id(module), module))

    def __reduce__(self):
        return (ReplicaZeroGrad, (self._module(),))
