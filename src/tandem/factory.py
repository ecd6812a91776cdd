"""``package.module:function`` references (``-a pkg.mod:make_net``, ``--data pkg.mod:load``): a
model or data set of the user's own, by name, imported again by eval, resume and every rank.

The current directory goes first on ``sys.path``, as with ``python -m``. A reference that fails
to import or call is one line; an error raised *inside* the function keeps its traceback.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
import sys
from typing import Callable

from tandem.errors import UsageError, a, first_line
from tandem.suggest import did_you_mean

_NAME = r"[A-Za-z_]\w*"
_REFERENCE = re.compile(rf"^{_NAME}(\.{_NAME})*:{_NAME}(\.{_NAME})*$")


def is_reference(text) -> bool:
    """True when ``text`` has the form ``package.module:function`` (``a.b:C.make`` too)."""
    return isinstance(text, str) and _REFERENCE.match(text) is not None


def rebuildable(reference: str) -> bool:
    """False for one of torch's own classes (``torch.nn...:Sequential``, as ``tandem.fit``
    records a model it was handed): its layers are not in its name."""
    return not (is_reference(reference) and reference.split(".", 1)[0].split(":")[0] == "torch")


def _cwd_on_path() -> str:
    """Put the current directory first on ``sys.path`` (as ``python -m`` does); return it."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    return cwd


def names_module(name: str) -> bool:
    """True when ``name`` (``-a mymod``) is an importable module: found, not imported."""
    if not re.fullmatch(rf"{_NAME}(\.{_NAME})*", name):
        return False
    _cwd_on_path()
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _import(module_name: str, reference: str, what: str):
    if module_name == "__main__":
        raise UsageError(f"{what} '{reference}' was defined in a script run as __main__, "
                         f"which cannot be imported again",
                         hint="move it into a module and name it as module:function")
    cwd = _cwd_on_path()
    try:
        return importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or anything the module raised while importing
        hint = None
        if isinstance(exc, ModuleNotFoundError) and exc.name and (
                exc.name == module_name or module_name.startswith(exc.name + ".")):
            # the module named (or its package), not one that it imports
            hint = (f"modules are looked for in the current directory, {cwd}, and on "
                    f"PYTHONPATH: run tandem from the directory that holds "
                    f"{module_name.split('.')[0]}, or add that directory to PYTHONPATH")
        raise UsageError(f"{what} '{reference}': importing {module_name} failed: "
                         f"{type(exc).__name__}: {first_line(exc)}", hint=hint) from None


def resolve(reference: str, what: str) -> Callable:
    """The callable ``reference`` names (``what``: "model factory", "data factory")."""
    if not is_reference(reference):
        raise UsageError(f"{what} '{reference}' is not of the form package.module:function")
    module_name, _, attr = reference.partition(":")
    found, owner = _import(module_name, reference, what), module_name
    for part in attr.split("."):
        if not hasattr(found, part):
            names = [n for n in dir(found) if not n.startswith("_")]
            hint = did_you_mean(part, names)
            raise UsageError(f"{what} '{reference}': {owner} has no {part!r}{hint}")
        found, owner = getattr(found, part), part
    if not callable(found):
        raise UsageError(f"{what} '{reference}' is {a(type(found).__name__)}, not a function")
    return found


def call(reference: str, fn: Callable, what: str, *, offered: dict | None = None,
         required: dict | None = None):
    """``fn(**kwargs)``: the ``offered`` keywords (not None) its signature takes, and every
    ``required`` one; arguments that do not fit are one line naming ``reference``."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: offer nothing
        params = {}
    any_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in (offered or {}).items()
              if v is not None and (any_keyword or k in params)}
    kwargs.update(required or {})
    try:
        if params:
            inspect.signature(fn).bind(**kwargs)
    except TypeError as exc:
        given = ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) or "no arguments"
        raise UsageError(f"{what} '{reference}' cannot be called with {given}: "
                         f"{first_line(exc)}") from None
    return fn(**kwargs)
