"""``--compile``: compile a model with ``torch.compile`` before a strategy sets it up.

The model's ``__call__`` is compiled in place with :meth:`torch.nn.Module.compile`, not wrapped
in ``torch.compile(model)``'s ``OptimizedModule``. So the module keeps its class and its
``state_dict`` keys (no ``_orig_mod.`` prefix): checkpoints stay ordinary and load into an
uncompiled model, and wrappers such as DDP see the same module. Compiling is lazy: the first
call of each new kind (training, evaluation, a new batch shape) pays for it.

A strategy that cannot run a compiled model says why in ``compile_unsupported``; asking for
``--compile`` with it is a one-line ``ValueError`` naming the strategies that can.
"""

from __future__ import annotations

import shutil

from torch import nn

from tandem.config import COMPILE_MODES

from .base import _REGISTRY, Strategy

__all__ = ["COMPILE_MODES", "compile_model", "compiling_strategies", "check_compile",
           "compile_skip_reason"]


def compiling_strategies() -> list[str]:
    """Names of the registered strategies that can run a compiled model."""
    return sorted(name for name, cls in _REGISTRY.items() if cls.compile_unsupported is None)


def check_compile(strategy: Strategy | type[Strategy], device_type: str = "cpu") -> None:
    """Raise a one-line ``ValueError`` when ``--compile`` cannot work here.

    Checks the strategy's declared ability, and on the CPU that a C++ compiler exists
    (torch.compile's CPU backend generates and builds C++).
    """
    reason = strategy.compile_unsupported
    if reason:
        raise ValueError(f"--compile does not work with --strategy {strategy.name}: {reason}; "
                         f"use --strategy {' or '.join(compiling_strategies())}")
    if device_type == "cpu" and not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        raise ValueError("--compile on the CPU needs a C++ compiler (g++ or clang++) on PATH")


def compile_skip_reason(name: str, device_type: str = "cpu") -> str | None:
    """The one-line reason why registered strategy ``name`` cannot compile, else ``None``."""
    try:
        check_compile(_REGISTRY[name], device_type)
    except ValueError as exc:
        return str(exc)
    return None


def compile_model(strategy: Strategy, model: nn.Module, mode: str | None = None) -> nn.Module:
    """Compile ``model``'s ``__call__`` in place for ``strategy`` and return it.

    ``mode`` is one of :data:`COMPILE_MODES` (``None``/``"default"``: torch's default).
    """
    check_compile(strategy, strategy.device.type)
    if mode not in (None, *COMPILE_MODES):
        raise ValueError(f"bad --compile-mode {mode!r}: choose one of {', '.join(COMPILE_MODES)}")
    model.compile(mode=None if mode == "default" else mode)
    return model
