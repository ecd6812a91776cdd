"""A test hook that makes one worker fail on purpose, to check that the job fails as a whole.

Set ``TANDEM_INJECT_FAULT=RANK:STEP:MODE`` in the launcher's environment (every worker inherits
it). The worker with global rank ``RANK`` then fails when it starts training step ``STEP``
(counted from 1, one per forward with gradients). ``MODE`` is

- ``raise``: raise ``RuntimeError("injected fault on rank R at step S")`` (a Python error);
- ``exit``: ``os._exit(3)``, the process vanishes without cleanup (like a crash or OOM kill);
- ``hang``: sleep forever, so the other ranks block in their next collective until the
  process-group timeout fires;
- ``kill``: SIGKILL itself, as ``kill -9`` from outside would;
- ``partition``: take down its own network link (``GLOO_SOCKET_IFNAME``, in the network
  namespace of a two-machine test) and carry on, so both sides wait for the other;
- ``interrupt``: send SIGINT to its launcher (Ctrl-C on that node) and carry on.

Only the first attempt of a launch fails: a worker torchrun restarted
(``TORCHELASTIC_RESTART_COUNT`` above 0) runs clean, so a restart can finish the run.

Unset (the normal case) it does nothing. ``sitecustomize.py`` beside it installs the hook in
every `tandem` subprocess of the tests (see ``conftest.cli_env``).
"""

from __future__ import annotations

import os
import signal
import sys
import time

__all__ = ["FAULT_VAR", "parse_fault", "maybe_inject_fault"]

FAULT_VAR = "TANDEM_INJECT_FAULT"
_MODES = ("raise", "exit", "hang", "kill", "partition", "interrupt")


def parse_fault(text: str) -> tuple[int, int, str]:
    """``"1:2:raise"`` -> ``(1, 2, "raise")``; anything else is a ``ValueError`` naming it."""
    parts = text.split(":")
    if (len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit()
            or parts[2] not in _MODES):
        raise ValueError(f"{FAULT_VAR}={text!r}: expected RANK:STEP:MODE with MODE in {_MODES}")
    return int(parts[0]), int(parts[1]), parts[2]


def maybe_inject_fault(rank: int, step: int, environ=None) -> None:
    """Fail as ``TANDEM_INJECT_FAULT`` asks if it names this ``rank`` and ``step``."""
    environ = os.environ if environ is None else environ
    text = environ.get(FAULT_VAR)
    if not text:
        return
    fault_rank, fault_step, mode = parse_fault(text)
    if rank != fault_rank or step != fault_step or environ.get("TORCHELASTIC_RESTART_COUNT",
                                                               "0") != "0":
        return
    message = f"injected fault on rank {rank} at step {step}"
    if mode == "raise":
        raise RuntimeError(message)
    print(f"tandem: {message} ({mode})", file=sys.stderr, flush=True)
    if mode == "exit":
        os._exit(3)
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "partition":
        import subprocess

        subprocess.run(["ip", "link", "set", environ["GLOO_SOCKET_IFNAME"], "down"], check=True)
        return
    if mode == "interrupt":
        os.kill(os.getppid(), signal.SIGINT)  # the launcher: torchrun's agent runs in it
        return
    # A worker stuck in a collective never gets back to Python to run tandem's SIGTERM handler,
    # so torchrun SIGKILLs it after a 30 s grace; this one dies of the SIGTERM at once instead.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    while True:  # hang: the peers' collectives must time out
        time.sleep(60)
