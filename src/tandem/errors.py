"""tandem's own errors: mistakes in what it was given, reported by the CLI as one line.

Each also derives from the built-in error a caller expects (``ValueError``, ...).
"""

from __future__ import annotations

__all__ = ["TandemError", "UsageError", "MissingFileError", "CheckpointError",
           "TrainingDiverged", "first_line"]


class TandemError(Exception):
    """A mistake of the user's: a bad value, file or combination of settings.

    The CLI prints it as one line (none where ``quiet``) and exits with ``exit_status``.
    """

    exit_status = 2
    quiet = False

    def __init__(self, *args, quiet: bool | None = None):
        super().__init__(*args)
        if quiet is not None:  # a process other than the one that speaks for the job
            self.quiet = quiet


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


def first_line(exc: BaseException, limit: int | None = 200) -> str:
    """The first line of ``exc``'s message (at most ``limit`` characters, ``None``: all), for
    one-line errors; the exception's type name when the message is empty."""
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:limit]
