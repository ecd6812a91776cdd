"""The model registry: small entry points looked up by name, as timm's.

:func:`create_model` checks options against the entry point's signature (a misspelt one is an
error). ``package.module:function`` is a factory of the user's own (:mod:`tandem.factory`).
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Callable

from torch import nn
from tandem import factory
from tandem.errors import UsageError, a
from tandem.suggest import closest_names


@dataclass(frozen=True)
class ModelInfo:
    """What the registry knows about one model without building it."""

    name: str
    fn: Callable[..., nn.Module]
    native_input_size: int
    min_input_size: int
    family: str

    @property
    def default_num_classes(self) -> int:
        """The entry point's own ``num_classes`` default (``None`` for a factory without one)."""
        param = inspect.signature(self.fn).parameters.get("num_classes")
        return None if param is None or param.default is param.empty else param.default

    @property
    def options(self) -> list[str]:
        """Keyword arguments the entry point accepts."""
        return list(inspect.signature(self.fn).parameters)


_REGISTRY: dict[str, ModelInfo] = {}

#: the ``family`` of a ``package.module:function`` model (sizes unknown: 0 native, 1 minimum)
FACTORY = "factory"


def register_model(*, native_input_size: int, min_input_size: int, family: str,
                   name: str | None = None):
    """Decorator adding an entry point, which takes ``num_classes`` and ``in_channels`` with
    defaults, under ``name`` (default: its own). ``native_input_size``: where ``tandem models``
    counts MACs; ``min_input_size``: what data is checked against."""

    def wrap(fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        key = fn.__name__ if name is None else name
        if key in _REGISTRY:
            raise UsageError(f"model {key!r} is registered twice")
        params = inspect.signature(fn).parameters
        for required in ("num_classes", "in_channels"):
            if required not in params or params[required].default is inspect.Parameter.empty:
                raise TypeError(f"model entry point {key!r} needs a {required}=... default")
        _REGISTRY[key] = ModelInfo(key, fn, native_input_size, min_input_size, family)
        return fn

    return wrap


def list_models() -> list[str]:
    """Every registered model name, in natural order (``cifar_resnet20`` before ``..110``)."""
    return sorted(_REGISTRY, key=lambda name: [int(part) if part.isdigit() else part
                                               for part in re.split(r"(\d+)", name)])


def model_info(name: str) -> ModelInfo:
    """The :class:`ModelInfo` for ``name`` (a ``package.module:function`` is imported); an
    unknown name is a ``UsageError`` suggesting the closest ones."""
    if factory.is_reference(name):
        return ModelInfo(name, factory.resolve(name, "model factory"), 0, 1, FACTORY)
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UsageError(unknown_model_message(name)) from None


def unknown_model_message(name: str) -> str:
    """What to say about an unknown model ``name``."""
    names = list_models()
    close = closest_names(name, names)
    if not close:
        own = (f"; {name!r} is a module: name the function in it that builds your model, "
               f"{name}:FUNCTION" if factory.names_module(name) else
               "; a model of your own is named package.module:function")
        return f"unknown model {name!r}; valid models: {', '.join(names)}{own}"
    guess = close[0] if len(close) == 1 else ", ".join(close[:-1]) + " or " + close[-1]
    return (f"unknown model {name!r}: did you mean {guess}? (`tandem models` or list_models() "
            f"lists all {len(names)})")


def native_input_size(name: str) -> int:
    """The square image side ``name`` was designed for (224, 227 or 32)."""
    return model_info(name).native_input_size


def create_model(name: str, num_classes: int | None = None, **kwargs) -> nn.Module:
    """Build model ``name`` with freshly initialised weights; ``num_classes=None``: the model's
    own default. Every model accepts ``in_channels`` (default 3). Raises ``ValueError`` for an
    unknown name or option (suggesting or listing the valid ones) or a bad value."""
    info = model_info(name)
    if info.family == FACTORY:  # num_classes and in_channels where it takes them
        offered = {"num_classes": num_classes, "in_channels": kwargs.pop("in_channels", None)}
        model = factory.call(name, info.fn, "model factory", offered=offered, required=kwargs)
        if not isinstance(model, nn.Module):
            raise UsageError(f"model factory '{name}' returned {a(type(model).__name__)}, not "
                             f"a torch.nn.Module")
        return model
    accepted = info.options
    unknown = sorted(k for k in kwargs if k not in accepted)
    if unknown:
        raise UsageError(f"model {name!r} got unexpected option(s) {', '.join(unknown)}; "
                         f"it accepts: {', '.join(accepted)}")
    if num_classes is not None:
        kwargs["num_classes"] = num_classes
    for key in ("num_classes", "in_channels"):
        if key in kwargs:
            value = kwargs[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"model {name!r}: {key} must be a positive int, got {value!r}")
    return info.fn(**kwargs)

