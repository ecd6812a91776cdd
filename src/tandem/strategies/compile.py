"""``--compile``: compile a model with ``torch.compile`` before a strategy sets it up.

:func:`check_compile` validates (once, up front); :func:`compiled` compiles, the module saving
and loading the plain model's keys (no ``_orig_mod.``). ``nn.Module.compile()`` is not used: it
cannot trace an ``nn.Sequential`` ResNet as one graph.
"""

from __future__ import annotations

import shutil

import torch
from torch import nn

from tandem.errors import UsageError, param
from tandem.state_keys import register_plain_keys

from .base import Strategy, strategy_names


#: torch.compile's modes (``None``: torch's default)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def compiling_strategies() -> list[str]:
    """Names of the registered strategies that can run a compiled model."""
    return sorted(strategy_names(compile_unsupported=None))


def check_compile(strategy: Strategy | type[Strategy], device_type: str = "cpu") -> None:
    """Raise a one-line ``UsageError`` when ``--compile`` can't work (CPU: needs a C++ compiler)."""
    reason = strategy.compile_unsupported
    if reason:
        raise UsageError(f"{param('compile')} does not work with {param('strategy')} "
                         f"{strategy.name}: {reason}; use {param('strategy')} "
                         f"{' or '.join(compiling_strategies())}")
    if device_type == "cpu" and not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        raise UsageError(f"{param('compile')} on the CPU needs a C++ compiler (g++ or clang++) on "
                         "PATH")


def compiled(model: nn.Module, mode: str | None = None) -> nn.Module:
    """``torch.compile(model, mode=mode)`` whose state dict has the plain model's keys (only
    ``mode`` is checked here: whether the run can compile is :func:`check_compile`'s)."""
    if mode not in (None, *COMPILE_MODES):
        raise UsageError(f"bad {param('compile_mode')} {mode!r}: choose one of "
                         f"{', '.join(COMPILE_MODES)}")
    module = torch.compile(model, mode=None if mode == "default" else mode)
    register_plain_keys(module, "_orig_mod")  # where OptimizedModule keeps the model
    return module
