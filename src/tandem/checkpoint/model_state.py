"""A model's plain state dict, whatever wraps it, and loading one back with a clear report."""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from tandem.errors import CheckpointError

__all__ = ["unwrap", "plain_state_dict", "load_plain_state_dict", "load_model_state", "reason"]

_PREFIX = "module."


def unwrap(model: nn.Module) -> nn.Module:
    """Follow ``.module`` (DataParallel, DataParallelModel, torch DP/DDP...) to the inner model."""
    seen = set()
    while isinstance(getattr(model, "module", None), nn.Module) and id(model) not in seen:
        seen.add(id(model))
        model = model.module
    return model


def _strip_prefix(state: dict) -> dict:
    """Drop ``module.`` prefixes, but only when *every* key has one (as DataParallel saves)."""
    while state and all(isinstance(k, str) and k.startswith(_PREFIX) for k in state):
        state = OrderedDict((k[len(_PREFIX):], v) for k, v in state.items())
    return state


def plain_state_dict(model: nn.Module) -> dict:
    """The state dict of the plain model inside ``model``, buffers in, no ``module.`` prefix.

    Uses the model's ``plain_state_dict()`` when it has one, else follows ``.module``.
    """
    m = model
    while True:
        if callable(getattr(m, "plain_state_dict", None)):
            return _strip_prefix(m.plain_state_dict())
        inner = getattr(m, "module", None)
        if not isinstance(inner, nn.Module):
            return _strip_prefix(m.state_dict())
        m = inner


def load_plain_state_dict(model: nn.Module, state: dict) -> None:
    """Load a plain state dict into ``model`` or the object it wraps (strict)."""
    m = model
    while True:
        if callable(getattr(m, "load_plain_state_dict", None)):
            m.load_plain_state_dict(state)
            return
        inner = getattr(m, "module", None)
        if not isinstance(inner, nn.Module):
            m.load_state_dict(state, strict=True)
            return
        m = inner


def reason(exc: BaseException) -> str:
    """A short one-line reason from a (possibly long, multi-line) exception message."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    for ln in lines:  # torch's weights_only refusal hides the reason among advice
        low = ln.lower()
        if "unsupported global" in low or "unsupported operand" in low:
            return ln[:200]
    if not lines:
        return type(exc).__name__
    first = lines[0]
    cut = first.find(". ")
    return (first[:cut] if cut > 0 else first)[:200]


def _shape(t) -> str:
    return "[" + ",".join(str(d) for d in t.shape) + "]" if torch.is_tensor(t) else type(t).__name__


def _fit_report(state: dict, model: nn.Module) -> str | None:
    """``None`` when ``state`` fits ``model``, else a one-line summary of what does not."""
    expected = plain_state_dict(model)
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    mismatched = [k for k in expected if k in state and torch.is_tensor(expected[k])
                  and (not torch.is_tensor(state[k]) or state[k].shape != expected[k].shape)]
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing key{'s' * (len(missing) > 1)} (e.g. {missing[0]})")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected key{'s' * (len(unexpected) > 1)} "
                     f"(e.g. {unexpected[0]})")
    if mismatched:
        k = mismatched[0]
        parts.append(f"{len(mismatched)} shape mismatch{'es' * (len(mismatched) > 1)} "
                     f"({k}: checkpoint {_shape(state[k])} vs model {_shape(expected[k])})")
    return ", ".join(parts) or None


def load_model_state(model: nn.Module, ckpt: dict, path) -> None:
    """Load the weights of ``ckpt`` (read by :func:`load` from ``path``) into ``model``."""
    report = _fit_report(ckpt["state_dict"], model)
    if report:
        raise CheckpointError(f"checkpoint '{path}' does not fit the model: {report}")
    try:
        load_plain_state_dict(model, ckpt["state_dict"])
    except Exception as exc:
        raise CheckpointError(f"checkpoint '{path}' does not fit the model: "
                              f"{reason(exc)}") from None
