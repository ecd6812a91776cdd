"""The process environment, read once (:class:`Environment`), and what ``torchrun`` gives each
worker: the readers here take that copy, the rest plain values (:class:`Place`, :class:`DistEnv`).
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Iterator, Mapping

from tandem.errors import UsageError

#: Seconds a collective may wait for the other ranks before it raises (and the job ends).
DEFAULT_TIMEOUT = 120.0
TIMEOUT_VAR = "TANDEM_DIST_TIMEOUT"
#: Seconds a node waits for the others to come (``tandem launch --join-timeout``).
DEFAULT_JOIN_TIMEOUT = 300.0
JOIN_TIMEOUT_VAR = "TANDEM_JOIN_TIMEOUT"
#: Set by ``tandem launch``: one id per launch (the same across restarts), how this node was
#: started (JSON, for the command to continue), this node's index and address towards the master.
LAUNCH_ID_VAR = "TANDEM_LAUNCH_ID"
LAUNCH_VAR = "TANDEM_LAUNCH"
NODE_VAR, ADDR_VAR = "TANDEM_NODE_RANK", "TANDEM_NODE_ADDR"
LAUNCH_HINT = "run it with `tandem launch --nproc-per-node N -- train ...` or torchrun"
#: per-sample seconds per device (``"2,1"``, noisy: ``"1,1~0.4"``) that replace what ``--split
#: auto`` measures, for tests and demos (:func:`tandem.parallel.split.clock_from_spec`)
SPLIT_CLOCK_VAR = "TANDEM_SPLIT_CLOCK"
#: set to 1 to take this CPU as having bf16 (emulated: same numbers, slower), for tests
CPU_BF16_VAR = "TANDEM_CPU_BF16"

_REQUIRED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Environment(Mapping[str, str]):
    """The process's environment variables, copied once (:meth:`read`) and never changed."""

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


@dataclass(frozen=True)
class DistEnv:
    """One worker's place in the job, as torchrun (and ``tandem launch``) describe it (a one-line
    ``UsageError`` if inconsistent). ``node``/``addr``: this node's index and address towards the
    master; ``timeout``: seconds a collective waits; ``join_timeout``: seconds the ranks wait for
    each other; ``launch``: how ``tandem launch`` started this node."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    node: str = "0"
    addr: str = ""
    restart: int = 0
    restarts_left: int = 0
    shared_store: bool = False  # the workers' store is torchrun's agent's, kept across restarts
    timeout: float = DEFAULT_TIMEOUT
    join_timeout: float = DEFAULT_JOIN_TIMEOUT
    launch: dict | None = field(default=None, compare=False, hash=False)

    def __post_init__(self):
        if self.world_size < 1:
            raise UsageError(f"WORLD_SIZE={self.world_size} must be >= 1")
        if not 0 <= self.rank < self.world_size:
            raise UsageError(f"RANK={self.rank} must be in [0, WORLD_SIZE={self.world_size})")
        if self.local_world_size < 1:
            raise UsageError(f"LOCAL_WORLD_SIZE={self.local_world_size} must be >= 1")
        if not 0 <= self.local_rank < self.local_world_size:
            raise UsageError(f"LOCAL_RANK={self.local_rank} must be in [0, LOCAL_WORLD_SIZE="
                             f"{self.local_world_size})")
        if self.local_world_size > self.world_size:
            raise UsageError(
                f"LOCAL_WORLD_SIZE={self.local_world_size} exceeds WORLD_SIZE={self.world_size}")
        if not self.master_addr:
            raise UsageError("MASTER_ADDR is empty")
        if not 0 < self.master_port < 65536:
            raise UsageError(f"MASTER_PORT={self.master_port} is not a port number (1-65535)")

    @property
    def speaks_for_node(self) -> bool:
        """The one worker per machine that prints for it (local rank 0)."""
        return self.local_rank == 0


@dataclass(frozen=True)
class Place:
    """This process in its job and its switches, as plain values; the defaults: outside any job."""

    environ: Environment = field(default_factory=Environment, repr=False)
    torchrun: bool = False  # a torchrun worker (RANK and WORLD_SIZE set)
    dist: DistEnv | None = None  # torchrun's variables, in a job of several processes
    main: bool = True  # rank 0, or a process outside torchrun: it prints for the job
    speaks: bool = True  # local rank 0: it prints for its node
    restart: int = 0  # torchrun's restarts of this worker group
    launch_id: str | None = None  # tandem launch's id, the same across restarts
    run_id: str | None = None  # torchrun's TORCHELASTIC_RUN_ID
    cpu_bf16: bool | None = None  # TANDEM_CPU_BF16=1: True (else the CPU's flags say)
    split_clock: str | None = None  # TANDEM_SPLIT_CLOCK (None: real time)
    malloc_default: bool = False  # TANDEM_MALLOC=default: glibc's own thresholds

    @property
    def several(self) -> bool:
        return self.dist is not None

    @property
    def elastic(self) -> bool:
        """Started by ``tandem launch --nnodes MIN:MAX``: a change of nodes restarts the
        workers without counting a restart (torchrun's ``TORCHELASTIC_RESTART_COUNT``)."""
        return elastic_launch(self.dist.launch if self.dist else None)


def elastic_launch(launch: dict | None) -> bool:
    """``launch`` (``TANDEM_LAUNCH``'s description) is elastic, as ``LaunchSpec.elastic`` said."""
    return bool((launch or {}).get("elastic"))


def in_torchrun(environ: Mapping[str, str]) -> bool:
    """True in a torchrun worker (``RANK`` and ``WORLD_SIZE`` set)."""
    return "RANK" in environ and "WORLD_SIZE" in environ


def several_processes(environ: Mapping[str, str]) -> bool:
    """True in a torchrun worker of a job of two or more processes."""
    return in_torchrun(environ) and int(environ.get("WORLD_SIZE", "1")) > 1


def is_main_process(environ: Mapping[str, str]) -> bool:
    """True in the process that prints: rank 0, or any process outside torchrun."""
    return environ.get("RANK", "0") == "0"


def env_rank(environ: Mapping[str, str]) -> int:
    """This process's ``RANK`` (0 outside torchrun)."""
    return int(environ.get("RANK", "0"))


def _int(environ: Mapping[str, str], name: str) -> int:
    text = environ[name]
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"{name}={text!r} is not an integer", hint=LAUNCH_HINT) from None


def read_env(environ: Mapping[str, str], *, who: str = "a multi-process strategy") -> DistEnv:
    """torchrun's variables in ``environ``, checked; a missing one is a one-line error naming
    it. ``LOCAL_WORLD_SIZE`` defaults to ``WORLD_SIZE`` (older launchers do not set it)."""
    missing = [name for name in _REQUIRED if name not in environ]
    if missing:
        raise UsageError(f"{who} needs torchrun's environment ({', '.join(missing)} not set)",
                         hint=LAUNCH_HINT)
    world_size = _int(environ, "WORLD_SIZE")
    restart, most = restart_count(environ), _count(environ, "TORCHELASTIC_MAX_RESTARTS")
    try:
        launch = json.loads(environ.get(LAUNCH_VAR) or "null")
    except ValueError:
        launch = None
    return DistEnv(
        rank=_int(environ, "RANK"), world_size=world_size, local_rank=_int(environ, "LOCAL_RANK"),
        local_world_size=(_int(environ, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in environ
                          else world_size),
        master_addr=environ["MASTER_ADDR"], master_port=_int(environ, "MASTER_PORT"),
        node=environ.get(NODE_VAR) or environ.get("GROUP_RANK") or "0",
        addr=environ.get(ADDR_VAR) or socket.gethostname(),
        restart=restart, restarts_left=max(0, most - restart), timeout=dist_timeout(environ),
        shared_store=environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        join_timeout=_seconds(environ, JOIN_TIMEOUT_VAR, DEFAULT_JOIN_TIMEOUT),
        launch=launch if isinstance(launch, dict) and "nproc_per_node" in launch else None)


def _seconds(environ: Mapping[str, str], name: str, default: float) -> float:
    text = environ.get(name)
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"{name}={text!r} is not a number of seconds") from None
    if value <= 0:
        raise UsageError(f"{name}={text!r} must be > 0 seconds")
    return value


def dist_timeout(environ: Mapping[str, str]) -> float:
    """Seconds from ``TANDEM_DIST_TIMEOUT``, or :data:`DEFAULT_TIMEOUT`; must be > 0."""
    return _seconds(environ, TIMEOUT_VAR, DEFAULT_TIMEOUT)


def restart_count(environ: Mapping[str, str]) -> int:
    """How often torchrun has restarted this worker group (0 outside torchrun)."""
    return _count(environ, "TORCHELASTIC_RESTART_COUNT")


def _count(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ.get(name) or 0)
    except ValueError:
        return 0


def cpu_bf16_override(environ: Mapping[str, str]) -> bool | None:
    """``True`` when :data:`CPU_BF16_VAR` is 1, else ``None`` (the CPU's own flags say)."""
    return True if environ.get(CPU_BF16_VAR) == "1" else None


def split_clock(environ: Mapping[str, str]) -> str | None:
    """What :data:`SPLIT_CLOCK_VAR` says (``None``: not set, real time)."""
    return environ.get(SPLIT_CLOCK_VAR) or None


def malloc_left_alone(environ: Mapping[str, str]) -> bool:
    """True when ``TANDEM_MALLOC=default`` asks to keep glibc's own malloc thresholds."""
    return environ.get("TANDEM_MALLOC", "").strip().lower() == "default"


def threads_set(environ: Mapping[str, str]) -> bool:
    """True when ``OMP_NUM_THREADS`` is set (the user chose the intra-op threads)."""
    return "OMP_NUM_THREADS" in environ


def place_of(environ: Mapping[str, str]) -> Place:
    """What ``environ`` says of this process; torchrun's variables checked in a job of several."""
    torchrun = in_torchrun(environ)
    run_id = environ.get("TORCHELASTIC_RUN_ID") if torchrun else None
    return Place(environ=Environment(environ), torchrun=torchrun,
                 dist=read_env(environ) if several_processes(environ) else None,
                 main=is_main_process(environ), speaks=environ.get("LOCAL_RANK", "0") == "0",
                 restart=restart_count(environ), launch_id=environ.get(LAUNCH_ID_VAR) or None,
                 run_id=run_id, cpu_bf16=cpu_bf16_override(environ),
                 split_clock=split_clock(environ), malloc_default=malloc_left_alone(environ))
