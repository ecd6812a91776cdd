"""tandem's own errors: mistakes in what it was given, reported by the CLI as one line.

Each also derives from the built-in error a caller expects (``ValueError``, ...). A message
names a parameter through :func:`param` (``bad lr -1``; the CLI says ``bad --lr -1``); a
remedy goes in ``hint``, which the CLI prints on a line of its own, as git and pip do.
"""

from __future__ import annotations

import re
from typing import Callable

__all__ = ["TandemError", "UsageError", "MissingFileError", "CheckpointError",
           "TrainingDiverged", "first_line", "param", "quoted", "a"]

# A parameter's name in a message sits between two private-use characters no quoted value has
_OPEN, _CLOSE = "\ue000", "\ue001"
_PARAM = re.compile(f"{_OPEN}([^{_CLOSE}]*){_CLOSE}")


def param(name: str) -> str:
    """``name`` marked as a parameter: ``UsageError(f"bad {param('lr')} {lr}: must be > 0")``
    (a flag is taken as its parameter: ``--max-share`` is ``max_share``)."""
    if name.startswith("--"):
        name = name[2:].replace("-", "_")
    return f"{_OPEN}{name}{_CLOSE}"


def a(noun: str) -> str:
    """``noun`` with its indefinite article: ``a(int)`` is "an int", ``a("list")`` "a list"."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


class TandemError(Exception):
    """A mistake of the user's. The CLI prints it as one line (none where ``quiet``), then
    ``hint`` on a line of its own, and exits with ``exit_status``; ``str()`` holds both."""

    exit_status = 2
    quiet = False

    def __init__(self, *args, quiet: bool | None = None, hint: str | None = None):
        self.marked = args[0] if args and isinstance(args[0], str) else None  # str(): names
        self.hint_marked = hint
        if self.marked is not None:
            plain = _PARAM.sub(r"\1", self.marked)
            if hint:
                plain += "\nhint: " + _PARAM.sub(r"\1", hint)
            args = (plain, *args[1:])
        super().__init__(*args)
        if quiet is not None:  # a process other than the one that speaks for the job
            self.quiet = quiet

    @property
    def params(self) -> tuple[str, ...]:
        """The parameters the message names, in order."""
        return tuple(_PARAM.findall(self.marked or ""))

    def worded(self, name: Callable[[str], str]) -> str:
        """The message with each parameter written as ``name(parameter)`` says (the CLI: a flag)."""
        if self.marked is None:
            return str(self)
        return _PARAM.sub(lambda m: name(m.group(1)), self.marked)

    def hint(self, name: Callable[[str], str]) -> str | None:
        """The remedy, each parameter written as ``name(parameter)`` says (``None``: none)."""
        if not self.hint_marked:
            return None
        return _PARAM.sub(lambda m: name(m.group(1)), self.hint_marked)


class UsageError(TandemError, ValueError):
    """A bad value or combination of values; the message names the parameter."""


class MissingFileError(TandemError, FileNotFoundError):
    """A file or directory that was named does not exist."""


class CheckpointError(TandemError, ValueError):
    """A checkpoint cannot be read or does not fit; the message names the file."""


class TrainingDiverged(TandemError, FloatingPointError):
    """Training met a non-finite loss or weights and stopped, keeping the last finite
    checkpoint; exit status 3, so that scripts can tell it from a bad command (2)."""

    exit_status = 3


def first_line(exc: BaseException | str, limit: int | None = 200) -> str:
    """The first line (at most ``limit`` characters) of a message or ``exc``'s (empty: its type)."""
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:limit]


def quoted(exc: BaseException) -> str:
    """The first line of ``exc``'s message, its parameters still marked, for an error quoting it."""
    return first_line(getattr(exc, "marked", None) or exc)
