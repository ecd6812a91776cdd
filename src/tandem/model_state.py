"""A model's plain state dict, whatever wraps it, and loading one back with a clear report: the
one home of "unwrap". A wrapper that splits layers (hybrid) answers ``plain_state_dict`` and
``load_plain_state_dict``; any other is followed through ``.module``.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.errors import first_line
from tandem.state_keys import strip_wrappers


def unwrap(model: nn.Module) -> nn.Module:
    """The innermost model: what answers ``plain_state_dict``, else ``.module`` followed."""
    seen = set()
    while not callable(getattr(model, "plain_state_dict", None)) and \
            isinstance(getattr(model, "module", None), nn.Module) and id(model) not in seen:
        seen.add(id(model))
        model = model.module
    return model


def plain_state_dict(model: nn.Module) -> dict:
    """The state dict of the plain model inside ``model``, buffers in, no ``module.`` prefix."""
    inner = unwrap(model)
    if callable(getattr(inner, "plain_state_dict", None)):
        return strip_wrappers(inner.plain_state_dict(), nested=False)
    return strip_wrappers(inner.state_dict(), nested=False)


def fit_report(state: dict, expected: dict) -> str | None:
    """``None`` when ``state`` has ``expected``'s keys and shapes, else a one-line summary."""
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


def _shape(t) -> str:
    return "[" + ",".join(str(d) for d in t.shape) + "]" if torch.is_tensor(t) else type(t).__name__


def load_plain_state_dict(model: nn.Module, state: dict) -> None:
    """Load a plain state dict into the model ``model`` wraps (strict); a misfit is a
    ``ValueError`` saying in one line what is missing, extra or misshapen."""
    report = fit_report(state, plain_state_dict(model))
    if report:
        raise ValueError(report)
    inner = unwrap(model)
    try:
        if callable(getattr(inner, "load_plain_state_dict", None)):
            inner.load_plain_state_dict(state)
        else:
            inner.load_state_dict(state, strict=True)
    except Exception as exc:  # dtype trouble and the like, after the key check
        raise ValueError(first_line(exc)) from None
