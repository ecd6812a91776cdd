"""The process environment, read in one place, and what ``torchrun`` gives each worker.

:class:`Environment` is the one reading of ``os.environ``: a frozen copy that a run takes
once (:meth:`Environment.read`) and holds; every function here that takes ``environ`` reads
that copy, or the process's variables as they are now when given none. :func:`read_env` turns
torchrun's variables into a :class:`DistEnv` that checks itself, so a worker started by hand
fails at once with one line saying how to launch it, instead of waiting forever for peers.
``TANDEM_DIST_TIMEOUT`` bounds how long a collective waits for a dead peer.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Iterator, Mapping

from tandem.errors import UsageError

__all__ = ["Environment", "DistEnv", "read_env", "in_torchrun", "env_rank", "is_main_process",
           "dist_timeout", "DEFAULT_TIMEOUT",
           "TIMEOUT_VAR", "LAUNCH_HINT", "LAUNCH_ID_VAR", "LAUNCH_VAR", "launch_id", "restart_count",
           "restarts_left", "NODE_VAR", "ADDR_VAR", "speaks_for_node", "join_timeout",
           "DEFAULT_JOIN_TIMEOUT", "JOIN_TIMEOUT_VAR", "several_processes", "node_of",
           "address_of", "launch_described", "torchrun_run_id", "malloc_left_alone",
           "threads_set", "SPLIT_CLOCK_VAR", "split_clock", "CPU_BF16_VAR", "cpu_bf16_override"]

#: Seconds a collective may wait for the other ranks before it raises (and the job ends).
DEFAULT_TIMEOUT = 120.0
TIMEOUT_VAR = "TANDEM_DIST_TIMEOUT"
#: Seconds a node waits for the others to come (its master, every rank's roll call, the
#: checkpoint rank 0 sends), set by ``tandem launch --join-timeout``.
DEFAULT_JOIN_TIMEOUT = 300.0
JOIN_TIMEOUT_VAR = "TANDEM_JOIN_TIMEOUT"
#: Set by ``tandem launch`` for its workers: one id per launch, the same across restarts.
LAUNCH_ID_VAR = "TANDEM_LAUNCH_ID"
#: Set by ``tandem launch`` for its workers: how this node was started (JSON), for the command
#: a message gives to continue the run on each node.
LAUNCH_VAR = "TANDEM_LAUNCH"
#: Set by ``tandem launch``: this node's index and its address towards the master.
NODE_VAR, ADDR_VAR = "TANDEM_NODE_RANK", "TANDEM_NODE_ADDR"
LAUNCH_HINT = "run it with `tandem launch --nproc-per-node N -- train ...` or torchrun"

_REQUIRED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Environment(Mapping[str, str]):
    """The process's environment variables, copied once (:meth:`read`) and never changed.

    A mapping, so that every function here that takes ``environ`` takes it; a test gives
    one of its own (``Environment({"RANK": "1", ...})``) instead of setting variables.
    """

    values: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "values", MappingProxyType(dict(self.values)))

    @classmethod
    def read(cls) -> "Environment":
        """The variables of this process now: the one place tandem reads ``os.environ``."""
        return cls(os.environ)

    def __getitem__(self, name: str) -> str:
        return self.values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.values)

    def __len__(self) -> int:
        return len(self.values)


def _now(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    """``environ``, or this process's variables as they are now (:meth:`Environment.read`)."""
    return Environment.read() if environ is None else environ


@dataclass(frozen=True)
class DistEnv:
    """One worker's place in the job, as torchrun describes it.

    ``rank`` is global (0 .. world_size-1); ``local_rank`` indexes the workers on this machine
    and picks this worker's accelerator (``cuda:LOCAL_RANK``). ``__post_init__`` rejects
    inconsistent values with a ``ValueError`` naming the variable.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int

    def __post_init__(self):
        if self.world_size < 1:
            raise UsageError(f"WORLD_SIZE={self.world_size} must be >= 1")
        if not 0 <= self.rank < self.world_size:
            raise UsageError(f"RANK={self.rank} must be in [0, WORLD_SIZE={self.world_size})")
        if self.local_world_size < 1:
            raise UsageError(f"LOCAL_WORLD_SIZE={self.local_world_size} must be >= 1")
        if not 0 <= self.local_rank < self.local_world_size:
            raise UsageError(
                f"LOCAL_RANK={self.local_rank} must be in [0, LOCAL_WORLD_SIZE="
                f"{self.local_world_size})"
            )
        if self.local_world_size > self.world_size:
            raise UsageError(
                f"LOCAL_WORLD_SIZE={self.local_world_size} exceeds WORLD_SIZE={self.world_size}"
            )
        if not self.master_addr:
            raise UsageError("MASTER_ADDR is empty")
        if not 0 < self.master_port < 65536:
            raise UsageError(f"MASTER_PORT={self.master_port} is not a port number (1-65535)")


def in_torchrun(environ: Mapping[str, str] | None = None) -> bool:
    """True when this process looks like a torchrun worker (``RANK`` and ``WORLD_SIZE`` set)."""
    environ = _now(environ)
    return "RANK" in environ and "WORLD_SIZE" in environ


def several_processes(environ: Mapping[str, str] | None = None) -> bool:
    """True in a torchrun worker of a job of two or more processes."""
    environ = _now(environ)
    return in_torchrun(environ) and int(environ.get("WORLD_SIZE", "1")) > 1


def env_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's ``RANK`` (0 outside torchrun)."""
    environ = _now(environ)
    return int(environ.get("RANK", "0"))


def is_main_process(environ: Mapping[str, str] | None = None) -> bool:
    """True in the process that prints: rank 0, or any process outside torchrun."""
    environ = _now(environ)
    return environ.get("RANK", "0") == "0"


def _int(environ: Mapping[str, str], name: str) -> int:
    text = environ[name]
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"{name}={text!r} is not an integer ({LAUNCH_HINT})") from None


def read_env(environ: Mapping[str, str] | None = None, *, who: str = "a multi-process strategy"
             ) -> DistEnv:
    """Parse torchrun's variables from ``environ`` (default ``os.environ``).

    A missing variable is a one-line ``ValueError`` that names it and says how to launch.
    ``LOCAL_WORLD_SIZE`` defaults to ``WORLD_SIZE`` (one machine) when absent, as with older
    launchers that do not set it.
    """
    environ = _now(environ)
    missing = [name for name in _REQUIRED if name not in environ]
    if missing:
        raise UsageError(
            f"{who} needs torchrun's environment ({', '.join(missing)} not set); "
            f"{LAUNCH_HINT}"
        )
    world_size = _int(environ, "WORLD_SIZE")
    local_world_size = (_int(environ, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in environ
                        else world_size)
    return DistEnv(
        rank=_int(environ, "RANK"),
        world_size=world_size,
        local_rank=_int(environ, "LOCAL_RANK"),
        local_world_size=local_world_size,
        master_addr=environ["MASTER_ADDR"],
        master_port=_int(environ, "MASTER_PORT"),
    )


def _seconds(environ: Mapping[str, str] | None, name: str, default: float) -> float:
    """Seconds from the variable ``name``, or ``default``; must be > 0."""
    text = _now(environ).get(name)
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"{name}={text!r} is not a number of seconds") from None
    if value <= 0:
        raise UsageError(f"{name}={text!r} must be > 0 seconds")
    return value


def dist_timeout(environ: Mapping[str, str] | None = None) -> float:
    """Seconds from ``TANDEM_DIST_TIMEOUT``, or :data:`DEFAULT_TIMEOUT`; must be > 0."""
    return _seconds(environ, TIMEOUT_VAR, DEFAULT_TIMEOUT)


def join_timeout(environ: Mapping[str, str] | None = None) -> float:
    """Seconds from ``TANDEM_JOIN_TIMEOUT``, or :data:`DEFAULT_JOIN_TIMEOUT`; must be > 0."""
    return _seconds(environ, JOIN_TIMEOUT_VAR, DEFAULT_JOIN_TIMEOUT)


def launch_id(environ: Mapping[str, str] | None = None) -> str | None:
    """The id ``tandem launch`` gave this launch (``TANDEM_LAUNCH_ID``; the same across torchrun
    restarts), or ``None`` outside one (an empty value names no launch)."""
    environ = _now(environ)
    return environ.get(LAUNCH_ID_VAR) or None


def restart_count(environ: Mapping[str, str] | None = None) -> int:
    """How often torchrun has restarted this worker group (0 outside torchrun)."""
    environ = _now(environ)
    try:
        return int(environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    except ValueError:
        return 0


def restarts_left(environ: Mapping[str, str] | None = None) -> int:
    """How many more times torchrun will restart this worker group after a failure."""
    environ = _now(environ)
    try:
        return max(0, int(environ.get("TORCHELASTIC_MAX_RESTARTS") or 0) - restart_count(environ))
    except ValueError:
        return 0


def speaks_for_node(environ: Mapping[str, str] | None = None) -> bool:
    """True in the one process per machine that prints for it: local rank 0 (or any process
    outside torchrun). Rank 0 speaks for the job; the others' first worker for their node."""
    environ = _now(environ)
    return environ.get("LOCAL_RANK", "0") == "0"


def node_of(environ: Mapping[str, str] | None = None) -> str:
    """This worker's node index as the launcher numbered it (``TANDEM_NODE_RANK``, else
    torchrun's ``GROUP_RANK``; ``"0"`` outside a launch)."""
    environ = _now(environ)
    return environ.get(NODE_VAR) or environ.get("GROUP_RANK") or "0"


def address_of(environ: Mapping[str, str] | None = None) -> str:
    """This node's address towards the master (``TANDEM_NODE_ADDR``), else its host name."""
    return _now(environ).get(ADDR_VAR) or socket.gethostname()


def launch_described(environ: Mapping[str, str] | None = None) -> dict | None:
    """How ``tandem launch`` started this node (``TANDEM_LAUNCH``'s JSON), or ``None``."""
    try:
        launch = json.loads(_now(environ).get(LAUNCH_VAR) or "null")
    except ValueError:
        return None
    return launch if isinstance(launch, dict) and "nproc_per_node" in launch else None


def torchrun_run_id(environ: Mapping[str, str] | None = None) -> str | None:
    """torchrun's ``TORCHELASTIC_RUN_ID`` in a torchrun worker, else ``None``."""
    environ = _now(environ)
    return environ.get("TORCHELASTIC_RUN_ID") if in_torchrun(environ) else None


def malloc_left_alone(environ: Mapping[str, str] | None = None) -> bool:
    """True when ``TANDEM_MALLOC=default`` asks to keep glibc's own malloc thresholds."""
    return _now(environ).get("TANDEM_MALLOC", "").strip().lower() == "default"


def threads_set(environ: Mapping[str, str] | None = None) -> bool:
    """True when ``OMP_NUM_THREADS`` is set (the user chose the intra-op threads)."""
    return "OMP_NUM_THREADS" in _now(environ)


# -- test switches: the one read of each, passed by the callers into the engine ------------------
#: per-sample seconds per device (``"2,1"``, noisy: ``"1,1~0.4"``) that replace what
#: ``--split auto`` measures: for tests and demos that must decide the same shares on every run
#: (:func:`tandem.parallel.split.clock_from_spec`)
SPLIT_CLOCK_VAR = "TANDEM_SPLIT_CLOCK"
#: set to 1 to take this CPU as having bf16 (bf16 is then emulated: same numbers, slower): for
#: tests, and for checking an ``--amp`` recipe on a machine without bf16 instructions
CPU_BF16_VAR = "TANDEM_CPU_BF16"


def split_clock(environ: Mapping[str, str] | None = None) -> str | None:
    """What :data:`SPLIT_CLOCK_VAR` says (``None``: not set, real time)."""
    environ = _now(environ)
    return environ.get(SPLIT_CLOCK_VAR) or None


def cpu_bf16_override(environ: Mapping[str, str] | None = None) -> bool | None:
    """``True`` when :data:`CPU_BF16_VAR` is 1 (take this CPU as computing bf16), else ``None``
    (its own flags say): ``tandem.precision.amp_precision``'s ``cpu_bf16``."""
    environ = _now(environ)
    return True if environ.get(CPU_BF16_VAR) == "1" else None
