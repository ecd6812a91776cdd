"""``--grad-compression``'s negative controls, each a context manager that patches tandem in
every worker of ``ddp_runs`` (``compression_controls:NAME``):

- ``no_error_feedback``: PowerSGD without its error feedback (each step's compression error
  is dropped instead of carried into the next step);
- ``no_handover``: PowerSGD's state is not handed from one bucket layout to the next (a resumed
  run's first layout, and DDP's second, start afresh), so a resume forgets the carried error.
"""

from __future__ import annotations

import contextlib
from unittest import mock

from tandem.distributed import compression

__all__ = ["no_error_feedback", "no_handover"]


@contextlib.contextmanager
def no_error_feedback():
    made = compression.PowerSGDState

    def without(*args, **kwargs):
        return made(*args, **{**kwargs, "use_error_feedback": False})

    with mock.patch.object(compression, "PowerSGDState", without):
        yield


@contextlib.contextmanager
def no_handover():
    with mock.patch.object(compression.Compressor, "_install", lambda self, layout, key: None):
        yield
