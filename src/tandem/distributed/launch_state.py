"""What a node's workers tell its launcher, for the line it says when they were aborted.

Under NCCL a failed collective ends every worker by SIGABRT. The node's first worker keeps a
JSON file (``TANDEM_LAUNCH_STATE``) up to date: the run directory, rank 0's last checkpoint
step, where each rank runs, and this node's command to continue (:func:`read`).
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from typing import Mapping


STATE_VAR = "TANDEM_LAUNCH_STATE"


class LaunchState:
    """The file at ``path``, written whole (atomically) at every :meth:`update`, one at a time."""

    def __init__(self, path: str):
        self.path, self.facts = path, {}
        self._lock = threading.Lock()

    @classmethod
    def of_worker(cls, environ: Mapping[str, str], speaks: bool) -> "LaunchState | None":
        """The launcher's file for the worker that ``speaks`` for the node; else ``None``."""
        path = environ.get(STATE_VAR)
        return cls(path) if path and speaks else None

    def update(self, **facts) -> None:
        with self._lock:
            self.facts.update(facts)
            try:
                fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path) or ".", prefix=".state-")
                with os.fdopen(fd, "w") as f:
                    json.dump(self.facts, f)
                os.replace(tmp, self.path)
            except OSError:  # the launcher then says less; training goes on
                pass

    def saved(self, step: int) -> None:
        """Rank 0's checkpoint of ``step`` is on its disk; an older word never replaces a newer."""
        if step >= (self.facts.get("saved_step") or -1):
            self.update(saved_step=step)


def read(path: str | None) -> dict:
    """What the workers last wrote to ``path`` (``{}``: nothing, or no file)."""
    if not path:
        return {}
    try:
        with open(path) as f:
            facts = json.load(f)
    except (OSError, ValueError):
        return {}
    return facts if isinstance(facts, dict) else {}
