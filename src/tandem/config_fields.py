"""How a config field carries its command-line flag: :func:`opt`, the resume policies, checks.

The sections in :mod:`tandem.config` (and ``tandem bench``'s) are built from :func:`opt`; the
CLI reads the ``metadata`` back (``tandem.cli.common``).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import field
from typing import Any, Callable

from tandem.errors import UsageError, param

# What a flag given with ``--resume`` may do (``on_resume`` in a field's metadata):
FIXED = "fixed"          # part of the run: a different value is refused
MAY_CHANGE = "may_change"  # where/how long it runs: taken from the run unless given, then said
PER_CALL = "per_call"    # this invocation only: never taken from the run


def opt(default: Any, help: str | Callable[[], str], *flags: str, choices: tuple | None = None,
        metavar: str | None = None, on_resume: str = FIXED, nargs: str | None = None,
        const: Any = None, per_node: bool = False):
    """A dataclass field carrying its CLI flags, help text and resume policy in ``metadata``.
    ``per_node``: each machine of a job may give its own value (the ranks compare every other
    field). ``help`` and ``choices`` may be callables, asked when the parser is built;
    ``default`` may be ``dataclasses.MISSING`` for a required field, whose flag defaults to None."""
    meta = {"help": help, "flags": flags, "choices": choices, "metavar": metavar,
            "on_resume": on_resume, "nargs": nargs, "const": const, "per_node": per_node}
    return field(default=default, metadata=meta)


def flag_of(f: dataclasses.Field) -> tuple[str, ...]:
    """The flags of field ``f`` (``--batch-size`` for ``batch_size`` unless metadata says)."""
    return tuple(f.metadata.get("flags") or ("--" + f.name.replace("_", "-"),))


def check(ok: bool, message: str) -> None:
    """Refuse with a one-line :class:`~tandem.errors.UsageError` unless ``ok``."""
    if not ok:
        raise UsageError(message)


def check_choice(value: str, choices: tuple, name: str) -> None:
    """Refuse ``value`` of parameter ``name`` unless it is one of ``choices``."""
    check(value in choices, f"bad {param(name)} {value!r}: choose one of {', '.join(choices)}")


def check_type(section, name: str, value) -> None:
    """``value`` has field ``name``'s type (an int is a float too; a bool is no int)."""
    hint = typing.get_type_hints(section)[name]
    allowed = tuple(t for t in typing.get_args(hint) or (hint,) if t is not type(None))
    if value is None and type(None) in typing.get_args(hint):
        return
    taken = allowed + (int,) if float in allowed else allowed
    ok = isinstance(value, taken) and not (isinstance(value, bool) and bool not in allowed)
    check(ok, f"bad {param(name)} {value!r}: must be {' or '.join(t.__name__ for t in allowed)}"
              f"{' or None' if type(None) in typing.get_args(hint) else ''}")
