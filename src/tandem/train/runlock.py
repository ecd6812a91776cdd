"""One run at a time in a run directory: ``RUN/run.lock`` names the process that writes there.

The main process (rank 0) takes the lock before it writes anything and removes it when the run
ends, however it ends (an exception, Ctrl-C). A second run into a directory in use is refused
in one line, ``--overwrite`` or not. A lock left by a process that has ended on this host is
taken over, and the run says so; so is one of this very launch (a torchrun restart under
``--max-restarts``, or another rank of it), matched by ``TANDEM_LAUNCH_ID`` or torchrun's agent.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time

from tandem.distributed.env import LAUNCH_ID_VAR, in_torchrun
from tandem.errors import UsageError

from .rundir import RunDir

__all__ = ["check_free", "check_saved", "held"]


def _me() -> dict:
    """What the lock file says about its owner: pid, host, and the launch it belongs to
    (``tandem launch``'s id, else a torchrun rendezvous id; ``agent``: torchrun's process)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID") if in_torchrun() else None
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "launch": os.environ.get(LAUNCH_ID_VAR) or (run_id if run_id != "none" else None),
            "agent": os.getppid() if in_torchrun() else None}


def _read(run: RunDir) -> dict | None:
    """The lock's owner (``None``: no lock; ``{}``: a lock that cannot be read)."""
    try:
        with open(run.lock_file, encoding="utf-8") as f:
            owner = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return owner if isinstance(owner, dict) else {}


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, TypeError, ValueError, OverflowError):
        return True  # another user's process, or a pid we cannot tell: assume it runs
    return True


def _same_launch(owner: dict, me: dict) -> bool:
    """True when ``owner`` is this process, or another rank or earlier restart of its launch."""
    if owner.get("host") == me["host"] and owner.get("pid") == me["pid"]:
        return True
    if me["launch"] and owner.get("launch") == me["launch"]:
        return True
    return bool(me["agent"]) and owner.get("host") == me["host"] and \
        owner.get("agent") == me["agent"]


def _stale(owner: dict, me: dict) -> bool:
    """True when the owner is a process on this host that has ended."""
    return owner.get("host") == me["host"] and not _alive(owner.get("pid"))


def _who(owner: dict) -> str:
    return f"process {owner.get('pid', '?')} on {owner.get('host', '?')}"


def _owner(run: RunDir) -> dict | None:
    """The lock's owner as :func:`_read` gives it, waiting up to 2 s while the lock reads empty
    (it may be being written, where hard links are not supported: :func:`_place`)."""
    owner = _read(run)
    for _ in range(20):
        if owner != {}:
            break
        time.sleep(0.1)
        owner = _read(run)
    return owner


def check_free(run: RunDir) -> None:
    """Refuse, in one line, a run into ``run`` while another run writes there."""
    owner, me = _owner(run), _me()
    if owner is None or _same_launch(owner, me) or _stale(owner, me):
        return
    if not owner.get("pid"):
        raise UsageError(f"run '{run.path}' has a {RunDir.LOCK} that names no owner (it cannot "
                         f"be read); if no run writes there, remove {run.lock_file}")
    raise UsageError(f"run '{run.path}' is in use by {_who(owner)} (its {RunDir.LOCK}); wait "
                     f"for it to end, or choose another --out (if that process has ended, "
                     f"remove {run.lock_file})")


def check_saved(resume: str) -> None:
    """Refuse, in one line, ``--resume RUN`` of a run directory that holds no checkpoint yet
    while another process writes there: naming that process (as the lock records it), not
    the missing file."""
    run = RunDir(resume)
    if not os.path.isdir(resume) or os.path.isfile(run.latest):
        return
    owner, me = _owner(run), _me()
    if not owner or _same_launch(owner, me) or _stale(owner, me):
        return
    raise UsageError(f"run '{run.path}' is in use by {_who(owner)} (its {RunDir.LOCK}) and has "
                     f"no checkpoint yet: that run has not saved its first step; let it run, "
                     f"or stop it (Ctrl-C saves), then --resume {run.path}")


def _place(run: RunDir, temp: str, me: dict) -> bool:
    """Put the lock in place whole, or return False when one exists: ``temp`` (holding ``me``)
    is hard-linked to it, so another rank never reads a lock half written (an empty file
    would name no owner). Where hard links are not supported the lock is created exclusively
    and then written (:func:`_owner` waits for its content)."""
    try:
        os.link(temp, run.lock_file)
        return True
    except FileExistsError:
        return False
    except OSError:  # a file system without hard links
        try:
            fd = os.open(run.lock_file, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(me, f)
        return True


def _take(run: RunDir, me: dict) -> str | None:
    """Write the lock; the line to say when an earlier owner's lock was taken over. ``me`` is
    written once, to a file beside the lock (named by host and pid, so no two processes that
    share the directory write the same one), then linked or renamed into place."""
    temp = f"{run.lock_file}.{me['host']}.{me['pid']}"
    with open(temp, "w", encoding="utf-8") as f:
        json.dump(me, f)
    try:
        if _place(run, temp, me):
            return None
        owner = _owner(run) or {}
        if not (_same_launch(owner, me) or _stale(owner, me)):
            check_free(run)  # taken meanwhile: refuse, naming its owner
        os.replace(temp, run.lock_file)  # atomic: a reader sees the old owner or the new one
        if _same_launch(owner, me):
            return None
        return f"took over {run.lock_file} from {_who(owner)}, which has ended"
    finally:
        with contextlib.suppress(OSError):
            os.remove(temp)  # linked, or refused (a replaced one is gone already)


@contextlib.contextmanager
def held(run: RunDir):
    """Hold ``run``'s lock while the block runs (the run directory is created if needed, and
    removed again if it is left empty); the lock is removed on the way out, whatever ends
    the block."""
    made = not os.path.isdir(run.path)
    run.create()
    me = _me()
    line = _take(run, me)
    if line:
        print(line, flush=True)
    try:
        yield
    finally:
        if (_read(run) or {}).get("pid") == me["pid"]:
            with contextlib.suppress(OSError):
                os.remove(run.lock_file)
        if made:  # a run refused before it wrote anything leaves no directory behind
            with contextlib.suppress(OSError):
                os.rmdir(run.path)  # only while empty
