"""What the wrappers do so that a module behaves in replicas as it does alone.

A call with no tensor to split runs the module once, on the first device. A lazy module gets
one dry forward on the first chunk in the caller's thread (eval mode, no grad), so replica
threads never race to materialise it. ``zero_grad`` in a replica warns and does nothing, as in
torch, the module itself (replica 0) included: :class:`ReplicaZeroGrad`, installed once.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Sequence

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from tandem.errors import UsageError

from .context import current
from .scatter_gather import batch_size, scatter_kwargs

__all__ = ["split_inputs", "first_lazy", "initialise_lazy", "ReplicaZeroGrad", "guard_zero_grad"]


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


class ReplicaZeroGrad:
    """A module's ``zero_grad`` that has no effect in a replica, as torch's replicas' has none.

    In a replica thread (a :class:`~tandem.parallel.context.ReplicaContext` is current) it
    warns and leaves every gradient alone; elsewhere it is the module's own ``zero_grad``.
    Replica 0 is the module itself, so its ``zero_grad`` must know where it is called from:
    torch's copies carry ``_is_replica``, which ``Module.zero_grad`` only warns about. Held
    weakly (no cycle through the module's ``__dict__``); a deep copy guards the copy.
    """

    __slots__ = ("_module",)

    def __init__(self, module: nn.Module):
        self._module = weakref.ref(module)

    def __call__(self, set_to_none: bool = True) -> None:
        if current() is not None:
            warnings.warn("zero_grad() in a DataParallel replica has no effect: the replicas' "
                          "gradients sum into the original module's parameters, so clear them "
                          "outside the forward (or use torch.autograd.grad there)", UserWarning,
                          stacklevel=2)
            return
        module = self._module()
        type(module).zero_grad(module, set_to_none)

    def __deepcopy__(self, memo):
        module = self._module()
        return ReplicaZeroGrad(memo.get(id(module), module))

    def __reduce__(self):
        return (ReplicaZeroGrad, (self._module(),))


def guard_zero_grad(module: nn.Module) -> None:
    """Give ``module`` (one module, not its tree) a :class:`ReplicaZeroGrad`, once; a
    ``zero_grad`` already in its ``__dict__`` (another one's) is left as it is."""
    d = module.__dict__
    if "zero_grad" not in d:
        d["zero_grad"] = ReplicaZeroGrad(module)
