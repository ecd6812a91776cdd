"""Ctrl-C and SIGTERM during training: the first signal stops every rank after the same step,
saved (:class:`Interrupted`); a second stops at once, but never inside
:meth:`StopRequest.critical` (a checkpoint write)."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """Training stopped on a signal after saving; ``str()`` says where and how to go on."""

    def __init__(self, message: str = "", signum: int = signal.SIGINT, quiet: bool = False):
        super().__init__(message)
        self.signum, self.quiet = signum, quiet


class StopRequest:
    """SIGINT/SIGTERM handlers for a ``with`` block (on the main thread only)."""

    def __init__(self, enabled: bool = True, quiet: bool = False, when: str = "after this step"):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.quiet, self.when = quiet, when  # when: as the first signal's line says it
        self.requested, self.signum = False, signal.SIGINT
        self._presses, self._critical, self._previous = 0, 0, {}

    def __enter__(self) -> "StopRequest":
        if self.enabled:
            self._previous = {s: signal.signal(s, self._on_signal) for s in _SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _on_signal(self, signum, frame) -> None:
        self._presses += 1
        if not self.requested:
            self.signum = signum
        self.requested = True
        if self._presses == 1:
            if not self.quiet:
                print(f"tandem: {signal.Signals(signum).name}: stopping {self.when} "
                      "(Ctrl-C again to stop at once)", file=sys.stderr, flush=True)
        elif not self._critical:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def critical(self):
        """A section that a signal never cuts short (e.g. writing a checkpoint)."""
        self._critical += 1
        try:
            yield
        finally:
            self._critical -= 1
        if self._presses > 1 and not self._critical:
            raise KeyboardInterrupt
