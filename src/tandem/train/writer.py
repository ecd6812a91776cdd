"""Rank 0's files written off the step's path by one thread, in order: a large checkpoint on
a slow disk would outlast the other ranks' collective timeout. A file handed over again before
its last copy was begun replaces it; a failed write is raised at the next hand-over or flush.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable

import torch

from tandem.errors import CheckpointError

def snapshot(obj: Any) -> Any:
    """``obj`` with every tensor in it (dicts, lists, tuples walked) copied to the CPU."""
    if torch.is_tensor(obj):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return type(obj)((k, snapshot(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(snapshot(v) for v in obj)
    return obj


class Writer:
    """One thread writing files in order; :attr:`written_step`: the last checkpoint's."""

    def __init__(self, slow_after: float | None = None, say: Callable[[str], None] | None = None,
                 on_written: Callable[[int], None] | None = None):
        self.slow_after, self.on_written = slow_after, on_written
        self.say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self.written_step: int | None = None
        self._pending: list[tuple[str, Callable[[], None], int | None, bool]] = []
        self._busy = False
        self._cv = threading.Condition()
        self._failed: BaseException | None = None
        self._thread: threading.Thread | None = None

    def write(self, what: str, job: Callable[[], None], step: int | None = None,
              supersedes: bool = True) -> None:
        """Run ``job`` (which writes ``what``) after those before it; with ``supersedes``, one
        for the same file not yet begun is replaced by it."""
        self._raise_failure()
        with self._cv:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tandem-writer", daemon=True)
                self._thread.start()
            kept = [p for p in self._pending if not (supersedes and p[0] == what and p[3])]
            self._pending = kept + [(what, job, step, supersedes)]
            self._cv.notify_all()

    def flush(self) -> None:
        """Wait until every job handed over is done; raise the first that failed."""
        with self._cv:
            self._cv.wait_for(lambda: not self._pending and not self._busy)
        self._raise_failure()

    def _raise_failure(self) -> None:
        failed, self._failed = self._failed, None
        if failed is not None:
            raise failed

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._pending)
                what, job, step, _ = self._pending.pop(0)
                self._busy = True
            started = time.monotonic()
            try:
                job()
                if step is not None:
                    self.written_step = step
                    if self.on_written is not None:
                        self.on_written(step)
            except BaseException as exc:  # kept for the main thread, which says it
                if self._failed is None:
                    self._failed = CheckpointError(f"could not write {what}: {exc}")
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()
            took = time.monotonic() - started
            if self.slow_after is not None and took > self.slow_after:
                self.say(f"tandem: writing {what} took {took:.1f} s, more than --dist-timeout "
                         f"({self.slow_after:.0f} s); training went on meanwhile (rank 0 "
                         "writes its files off the step's path)")
