"""Ctrl-C during training: stop between optimizer steps, never inside a checkpoint write.

Python turns SIGINT into a ``KeyboardInterrupt`` wherever the main thread happens to be. In a
training loop that can be inside ``torch.save`` (the zip writer then fails with a
``RuntimeError`` and a traceback) or inside a finalizer such as a weakref callback, where the
exception is printed as "Exception ignored" and training simply goes on. :class:`StopRequest`
makes the first Ctrl-C a *request*: the loop notices it after the current optimizer step,
saves a checkpoint at that exact position and raises ``KeyboardInterrupt`` itself (the CLI
prints ``tandem: interrupted`` and exits 130). A second Ctrl-C stops at once, except inside a
:meth:`StopRequest.critical` section (a checkpoint write), which always completes first.

Only single-process runs use it: under torch.distributed every rank must stop at the same
step or the others wait in a collective, so there the launcher's signal handling applies.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading

__all__ = ["StopRequest"]


class StopRequest:
    """SIGINT handler installed for the duration of a ``with`` block (when ``enabled``).

    ``requested`` is true once Ctrl-C was pressed. Outside the block, or when disabled (several
    processes, or not the main thread), it never becomes true and changes nothing.
    """

    def __init__(self, enabled: bool = True):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.requested = False
        self._presses = 0
        self._critical = 0
        self._previous = None

    def __enter__(self) -> "StopRequest":
        if self.enabled:
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            signal.signal(signal.SIGINT, self._previous)

    def _on_sigint(self, signum, frame) -> None:
        self._presses += 1
        self.requested = True
        if self._presses == 1:
            print("tandem: stopping after this step (Ctrl-C again to stop at once)",
                  file=sys.stderr, flush=True)
        elif not self._critical:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def critical(self):
        """A section that Ctrl-C never cuts short (e.g. writing a checkpoint)."""
        self._critical += 1
        try:
            yield
        finally:
            self._critical -= 1
        if self._presses > 1 and not self._critical:
            raise KeyboardInterrupt
