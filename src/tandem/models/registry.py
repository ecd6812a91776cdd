"""The model registry: small entry points, looked up by name.

Each model is a function decorated with :func:`register_model`, which records its
``native_input_size`` (where ``tandem models`` counts MACs) and ``min_input_size`` (what a data
set is checked against). :func:`create_model` checks keyword arguments against the entry point's
signature, so a misspelt option is an error naming the accepted ones, never a silent default.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Callable

from torch import nn
from tandem.errors import UsageError

__all__ = ["ModelInfo", "register_model", "create_model", "list_models", "model_info",
           "native_input_size"]


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
        """The entry point's own ``num_classes`` default (1000 ImageNet, 10 CIFAR)."""
        return inspect.signature(self.fn).parameters["num_classes"].default

    @property
    def options(self) -> list[str]:
        """Keyword arguments the entry point accepts."""
        return list(inspect.signature(self.fn).parameters)


_REGISTRY: dict[str, ModelInfo] = {}


def register_model(*, native_input_size: int, min_input_size: int, family: str):
    """Decorator adding an entry point to the registry under its function name.

    The function must take ``num_classes`` and ``in_channels`` keyword arguments with
    defaults. Registering a name twice is an error (two homes for one model).
    """

    def wrap(fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        name = fn.__name__
        if name in _REGISTRY:
            raise UsageError(f"model {name!r} is registered twice")
        params = inspect.signature(fn).parameters
        for required in ("num_classes", "in_channels"):
            if required not in params or params[required].default is inspect.Parameter.empty:
                raise TypeError(f"model entry point {name!r} needs a {required}=... default")
        _REGISTRY[name] = ModelInfo(name, fn, native_input_size, min_input_size, family)
        return fn

    return wrap


def list_models() -> list[str]:
    """Every registered model name, in natural order (``cifar_resnet20`` before ``..110``)."""
    _load_builtin_models()
    return sorted(_REGISTRY, key=_natural_key)


def _natural_key(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def model_info(name: str) -> ModelInfo:
    """The :class:`ModelInfo` for ``name``; ``ValueError`` listing valid names if unknown."""
    _load_builtin_models()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UsageError(
            f"unknown model {name!r}; valid models: {', '.join(list_models())}"
        ) from None


def native_input_size(name: str) -> int:
    """The square image side ``name`` was designed for (224, 227 or 32)."""
    return model_info(name).native_input_size


def create_model(name: str, num_classes: int | None = None, **kwargs) -> nn.Module:
    """Build model ``name`` with freshly initialised weights.

    ``num_classes=None`` means the model's own default (1000 for ImageNet, 10 for ``cifar_*``).
    Every model accepts ``in_channels`` (default 3); other options depend on the family. Raises
    ``ValueError`` for an unknown name or option (listing the valid ones) or a bad value.
    """
    info = model_info(name)
    accepted = info.options
    unknown = sorted(k for k in kwargs if k not in accepted)
    if unknown:
        raise UsageError(
            f"model {name!r} got unexpected option(s) {', '.join(unknown)}; "
            f"it accepts: {', '.join(accepted)}"
        )
    if num_classes is not None:
        kwargs["num_classes"] = num_classes
    for key in ("num_classes", "in_channels"):
        if key in kwargs:
            value = kwargs[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"model {name!r}: {key} must be a positive int, got {value!r}")
    return info.fn(**kwargs)


_loaded = False


def _load_builtin_models() -> None:
    # Importing the model modules runs their @register_model decorators. Done lazily so that
    # registry.py itself has no import cycle with the modules that use it.
    global _loaded
    if not _loaded:
        _loaded = True
        from tandem.models import alexnet, cifar_resnet, resnet, vgg  # noqa: F401
