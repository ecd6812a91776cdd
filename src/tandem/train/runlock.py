"""One run at a time in a run directory: ``RUN/run.lock`` names the process that writes there
(pid, host, launch) and holds an OS lock (``flock``) the kernel releases when it dies. A lock of
an ended process on this host, or of this very launch, is taken over.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from typing import IO

from tandem.distributed.env import Place
from tandem.errors import UsageError

from .rundir import RunDir


def _me(place: Place) -> dict:
    """The lock's record of this process: pid, host, launch id, torchrun's ``agent`` pid."""
    run_id = place.run_id
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "launch": place.launch_id or (run_id if run_id != "none" else None),
            "agent": os.getppid() if place.torchrun else None}


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


def _os_locked(run: RunDir) -> bool | None:
    """Whether a process holds the OS lock on ``run``'s lock file (``None``: cannot tell). A
    shared probe, so two processes looking at once never take each other for the owner."""
    try:
        fd = os.open(run.lock_file, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)  # releases the probe's lock
    return False


def _stale(run: RunDir, owner: dict, me: dict) -> bool:
    """True when the owner is an ended process on this host: by its OS lock when it took one
    (a reused pid cannot fool it), else by its pid."""
    if owner.get("host") != me["host"]:
        return False
    held = _os_locked(run) if owner.get("locked") else None
    return not held if held is not None else not _alive(owner.get("pid"))


def _who(owner: dict) -> str:
    return f"process {owner.get('pid', '?')} on {owner.get('host', '?')}"


def _owner(run: RunDir) -> dict | None:
    """:func:`_read`, waiting up to 2 s while the lock reads empty (it may be being written)."""
    for _ in range(20):
        owner = _read(run)
        if owner != {}:
            return owner
        time.sleep(0.1)
    return _read(run)


def check_free(run: RunDir, place: Place = Place(), me: dict | None = None) -> None:
    """Refuse a run into ``run`` while another run writes there (``me``: :func:`_me`)."""
    me = me or _me(place)
    owner = _owner(run)
    if owner is None or _same_launch(owner, me) or _stale(run, owner, me):
        return
    if not owner.get("pid"):
        raise UsageError(f"run '{run.path}' has a {RunDir.LOCK} that names no owner (it cannot "
                         f"be read); if no run writes there, remove {run.lock_file}")
    raise UsageError(f"run '{run.path}' is in use by {_who(owner)} (its {RunDir.LOCK}); wait "
                     f"for it to end, or choose another --out (if that process has ended, "
                     f"remove {run.lock_file})")


def check_saved(resume: str, place: Place = Place()) -> None:
    """Refuse ``--resume`` of a run not saved yet while its process writes there."""
    run = RunDir(resume)
    if not os.path.isdir(resume) or os.path.isfile(run.latest):
        return
    owner, me = _owner(run), _me(place)
    if not owner or _same_launch(owner, me) or _stale(run, owner, me):
        return
    raise UsageError(f"run '{run.path}' is in use by {_who(owner)} (its {RunDir.LOCK}) and has "
                     f"no checkpoint yet: that run has not saved its first step; let it run, "
                     f"or stop it (Ctrl-C saves), then --resume {run.path}")


def _write(f: IO, me: dict) -> None:
    """Write ``me`` to the open lock file ``f``, holding its OS lock while ``f`` stays open."""
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        locked = True
    except OSError:
        locked = False
    json.dump(dict(me, locked=locked), f)
    f.flush()


def _place(run: RunDir, temp: IO, me: dict) -> IO | None:
    """Put the lock in place whole (``temp`` hard-linked, so no rank reads it half written;
    else created exclusively, then written); the open file holding it, or ``None`` if one exists."""
    try:
        os.link(temp.name, run.lock_file)
        return temp
    except FileExistsError:
        return None
    except OSError:  # a file system without hard links
        try:
            fd = os.open(run.lock_file, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return None
        f = os.fdopen(fd, "w", encoding="utf-8")
        _write(f, me)
        return f


def _take(run: RunDir, me: dict) -> tuple[IO, str | None]:
    """Write the lock (to a file beside it named by host and pid, then linked or renamed into
    place); the open file that holds it, and the line to say when an ended owner's was taken."""
    temp = f"{run.lock_file}.{me['host']}.{me['pid']}"
    f = open(temp, "w", encoding="utf-8")
    try:
        _write(f, me)
        placed = _place(run, f, me)
        if placed is not None:
            if placed is not f:
                f.close()
            return placed, None
        owner = _owner(run) or {}
        if not (_same_launch(owner, me) or _stale(run, owner, me)):
            check_free(run, me=me)  # taken meanwhile: refuse, naming its owner
        os.replace(temp, run.lock_file)  # atomic: a reader sees the old owner or the new one
        if _same_launch(owner, me):
            return f, None
        return f, f"took over {run.lock_file} from {_who(owner)}, which has ended"
    except BaseException:
        f.close()
        raise
    finally:
        with contextlib.suppress(OSError):
            os.remove(temp)  # linked, or refused (a replaced one is gone already)


@contextlib.contextmanager
def held(run: RunDir, place: Place = Place()):
    """Hold ``run``'s lock while the block runs; removed however the block ends."""
    made = not os.path.isdir(run.path)
    run.create()
    me = _me(place)
    f, line = _take(run, me)
    if line:
        print(line, flush=True)
    try:
        yield
    finally:
        with f:  # closed last: the file is removed while its OS lock is held
            if (_read(run) or {}).get("pid") == me["pid"]:
                with contextlib.suppress(OSError):
                    os.remove(run.lock_file)
        if made:  # a run refused before it wrote anything leaves no directory behind
            with contextlib.suppress(OSError):
                os.rmdir(run.path)  # only while empty
