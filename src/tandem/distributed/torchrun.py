"""``tandem launch``: a tandem command on many processes and machines, through torchrun.

Adds a free-port check, ``--dist-timeout``, a one-line failure summary, ``TANDEM_LAUNCH_ID``
(restarted workers resume their run) and, on several machines, the interface that reaches the
master (:mod:`.network`), waiting lines and ``TANDEM_LAUNCH`` (each node's command to continue).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field

from tandem.errors import UsageError, param

from . import launch_state, network
from .env import (ADDR_VAR, DEFAULT_JOIN_TIMEOUT, JOIN_TIMEOUT_VAR, LAUNCH_ID_VAR, LAUNCH_VAR,
                  NODE_VAR, TIMEOUT_VAR)
from .join import SAY_EVERY, JoinFailed, every


_SUBCOMMANDS = ("train", "eval", "bench", "models")

_RDZV_LOGGER = "torch.distributed.elastic.agent.server.api"
# torchrun's agent's warnings while it stops the workers, which tandem says itself (matched by
# template: anything else it logs still shows)
_AGENT_LOGGERS = (_RDZV_LOGGER, "torch.distributed.elastic.multiprocessing.api",
                  "torch.distributed.elastic.rendezvous.dynamic_rendezvous")
_AGENT_NOISE = frozenset({"Received %s death signal, shutting down workers",
                          "Got termination signal: %s", "Sending process %s closing signal %s"})
# the agent's error line for a failed worker: the worker's own line, or tandem launch's, says it
_AGENT_FAILED = "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s"
# an agent waiting for the others in node 0's store after the job, when node 0 left first
_EXIT_BARRIER = "Error waiting on exit barrier. Elapsed: %s seconds"
#: a worker's exit status after its one line said a peer was lost (:mod:`.faults`) or never came
TOLD_EXIT = JoinFailed.exit_status
# exit statuses after which the worker's own line said all (a TandemError's; a saved stop)
_TOLD = (2, 3, TOLD_EXIT, 128 + signal.SIGINT, 128 + signal.SIGTERM)


@dataclass(frozen=True)
class LaunchSpec:
    """What ``tandem launch`` was asked to run; ``__post_init__`` rejects what cannot work.
    ``nnodes``: ``"M"`` or ``"MIN:MAX"`` (elastic); ``master_port`` None/0 on one node: a free
    one. The workers run ``python -m MODULE COMMAND`` (``tandem``: one of its subcommands)."""

    nproc_per_node: int
    command: list[str]
    nnodes: str = "1"
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_backend: str | None = None
    rdzv_id: str | None = None
    rdzv_conf: str | None = None  # torchrun's --rdzv-conf KEY=VALUE,... (the user's win)
    max_restarts: int = 0
    dist_timeout: float | None = None
    iface: str | None = None
    join_timeout: float | None = None
    slurm: bool = False  # the node count, rank and master came from SLURM's variables
    extra_env: dict = field(default_factory=dict)
    module: str = "tandem"

    def __post_init__(self):
        if self.nproc_per_node < 1:
            raise UsageError(f"bad {param('nproc_per_node')} {self.nproc_per_node}: must be >= 1")
        if not self.command:
            raise UsageError("no command to launch: add it after `--`, e.g. "
                             "`tandem launch --nproc-per-node 2 -- train --strategy ddp`")
        if self.module == "tandem" and self.command[0] not in _SUBCOMMANDS:
            raise UsageError(f"cannot launch {self.command[0]!r}: the command after `--` must "
                             f"be a tandem subcommand ({', '.join(_SUBCOMMANDS)})")
        lo, hi = _parse_nnodes(self.nnodes)
        if lo != hi and not self.rdzv_endpoint:
            raise UsageError(f"{param('nnodes')} {self.nnodes} (elastic) needs "
                             f"{param('rdzv_endpoint')}")
        if lo != hi and not self.rdzv_id:
            raise UsageError(f"{param('nnodes')} {self.nnodes} (elastic) needs "
                             f"{param('rdzv_id')} JOB",
                             hint="the same id on every node and a new one for each job: a "
                                  "node that joins continues the run of that id")
        if self.rdzv_conf and not self.rdzv_endpoint:
            raise UsageError(f"{param('rdzv_conf')} needs {param('rdzv_endpoint')}")
        _rdzv_conf(self.rdzv_conf)  # a malformed one is refused here
        if self.max_restarts < 0:
            raise UsageError(f"bad {param('max_restarts')} {self.max_restarts}: must be >= 0")
        for name in ("dist_timeout", "join_timeout"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise UsageError(f"bad {param(name)} {getattr(self, name)}: must be > 0 seconds")
        if self.master_port is not None and not 0 <= self.master_port < 65536:
            raise UsageError(f"bad {param('master_port')} {self.master_port}: must be 0-65535")
        if self.rdzv_endpoint:
            if self.master_addr or self.master_port:
                raise UsageError(f"give either {param('rdzv_endpoint')} or "
                                 f"{param('master_addr')}/{param('master_port')}, not both")
            return
        if self.rdzv_backend or self.rdzv_id:
            raise UsageError(f"{param('rdzv_backend')} and {param('rdzv_id')} need "
                             f"{param('rdzv_endpoint')}")
        if not 0 <= self.node_rank < hi:
            raise UsageError(f"bad {param('node_rank')} {self.node_rank}: must be in [0, {hi}) "
                             f"for {param('nnodes')} {self.nnodes}")
        if hi > 1 and (not self.master_addr or not self.master_port):
            raise UsageError(f"{param('nnodes')} {self.nnodes} needs {param('master_addr')} and a "
                             f"non-zero {param('master_port')} (the address and port of node 0), "
                             f"or {param('rdzv_endpoint')} HOST:PORT")

    @property
    def elastic(self) -> bool:
        """``--nnodes MIN:MAX`` with MIN < MAX: nodes may join and leave the running job."""
        lo, hi = _parse_nnodes(self.nnodes)
        return lo < hi

    @property
    def multi_node(self) -> bool:
        return _parse_nnodes(self.nnodes)[1] > 1

    @property
    def master(self) -> tuple[str, int] | None:
        """The host and port every node meets at (None: one node picking its own port)."""
        if self.rdzv_endpoint:
            host, _, port = self.rdzv_endpoint.rpartition(":")
            return (host or self.rdzv_endpoint), int(port) if port.isdigit() else 29400
        if self.multi_node or self.master_port:
            return self.master_addr or "127.0.0.1", int(self.master_port or 0)
        return None

    def described(self) -> str:
        """What the workers need to print each node's command (``TANDEM_LAUNCH``)."""
        keep = ("nproc_per_node", "nnodes", "master_addr", "master_port", "rdzv_endpoint",
                "rdzv_backend", "rdzv_id", "rdzv_conf", "max_restarts", "dist_timeout",
                "join_timeout", "iface", "slurm")
        return json.dumps({**{k: v for k, v in asdict(self).items() if k in keep},
                           "elastic": self.elastic})


def _parse_nnodes(text: str) -> tuple[int, int]:
    parts = str(text).split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, 0)
    except ValueError:
        lo = hi = 0
    if lo < 1 or hi < lo:
        raise UsageError(f"bad {param('nnodes')} {text!r}: expected M or MIN:MAX with "
                         "1 <= MIN <= MAX")
    return lo, hi


def _rdzv_conf(text: str | None) -> dict[str, str]:
    """``--rdzv-conf``'s ``KEY=VALUE,...`` as a dict; a malformed one is a ``UsageError``."""
    pairs = [part.partition("=") for part in (text or "").split(",") if part.strip()]
    bad = [key + eq + value for key, eq, value in pairs if not (key.strip() and eq)]
    if bad:
        raise UsageError(f"bad {param('rdzv_conf')} {text!r}: expected KEY=VALUE,... "
                         f"(e.g. last_call_timeout=10), not {bad[0]!r}")
    return {key.strip(): value.strip() for key, _, value in pairs}


def check_port_free(addr: str, port: int) -> None:
    """A one-line error when ``port`` is taken here (racy: one taken later fails in torchrun)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise UsageError(f"port {port} on {addr} is already in use; pick another with "
                                 f"{param('master_port')}") from None
            raise UsageError(f"cannot use port {port} on {addr}: {exc.strerror}") from None


def torchrun_argv(spec: LaunchSpec, local_addr: str | None = None,
                  hosts_endpoint: bool | None = None) -> list[str]:
    """The ``torchrun`` arguments for ``spec``; ``local_addr``: this node's address towards the
    master; ``hosts_endpoint``: whether this machine holds the rendezvous endpoint's address."""
    argv = ["--nnodes", str(spec.nnodes), "--nproc-per-node", str(spec.nproc_per_node),
            "--max-restarts", str(spec.max_restarts)]
    if not (spec.rdzv_endpoint or spec.multi_node or spec.master_port):
        # one node, no port: a free one (older torch takes 29500, which two jobs collide on),
        # and the loopback address (a container's FQDN may not resolve)
        argv += ["--standalone", "--local-addr", "127.0.0.1"]
    elif spec.rdzv_endpoint:
        argv += ["--rdzv-backend", spec.rdzv_backend or "c10d",
                 "--rdzv-endpoint", spec.rdzv_endpoint]
        if spec.rdzv_id:
            argv += ["--rdzv-id", spec.rdzv_id]
        conf = {}
        if hosts_endpoint is not None and (spec.rdzv_backend or "c10d") == "c10d":
            # torch finds the endpoint's machine by its host name, which misses a 127.0.0.1 one
            conf["is_host"] = str(int(hosts_endpoint))
        conf.update(_rdzv_conf(spec.rdzv_conf))
        if conf:
            argv += ["--rdzv-conf", ",".join(f"{k}={v}" for k, v in conf.items())]
    else:
        argv += ["--node-rank", str(spec.node_rank),
                 "--master-addr", spec.master_addr or "127.0.0.1"]
        if spec.master_port:
            argv += ["--master-port", str(spec.master_port)]
        if spec.multi_node:  # how long node 0's store waits for the other nodes to connect
            argv += ["--rdzv-conf", f"timeout={int(join_timeout(spec))}"]
    if local_addr:
        argv += ["--local-addr", local_addr]
    return argv + ["-m", spec.module, *spec.command]


def join_timeout(spec: LaunchSpec) -> float:
    return spec.join_timeout if spec.join_timeout is not None else DEFAULT_JOIN_TIMEOUT


def _exit_code(failure_code: int) -> int:
    """A worker's exit code as a process exit status (killed by signal N -> 128 + N)."""
    return 128 - failure_code if failure_code < 0 else failure_code or 1


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _not_noise(record: logging.LogRecord) -> bool:
    if record.msg in (_AGENT_FAILED, _EXIT_BARRIER):
        return False  # the worker told why, or tandem launch's own line does
    if "has failed to shutdown the rendezvous" in str(record.msg):
        return False  # its host (node 0) left first, after the job was done
    return not (record.levelno < logging.ERROR and record.msg in _AGENT_NOISE)


@contextlib.contextmanager
def quiet_agent():
    """Drop torchrun's agent warnings in :data:`_AGENT_NOISE` meanwhile (its errors show)."""
    loggers = [logging.getLogger(name) for name in _AGENT_LOGGERS]
    for logger in loggers:
        logger.addFilter(_not_noise)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(_not_noise)


def launch(spec: LaunchSpec) -> int:
    """Run the job described by ``spec`` and return its exit status (0 when every rank did)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    route = _network(spec)  # several nodes: the interface towards the master, or a refusal
    if not spec.rdzv_endpoint and spec.master_port and spec.node_rank == 0:
        check_port_free(spec.master_addr or "127.0.0.1", spec.master_port)
    for var, value in ((TIMEOUT_VAR, spec.dist_timeout), (JOIN_TIMEOUT_VAR, spec.join_timeout)):
        if value is not None:
            os.environ[var] = str(value)
    if spec.nproc_per_node > 1:
        # one intra-op thread per worker, as torchrun would (with a banner); the user's wins
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    # one id for this launch, the same on every node and in restarted workers (their run dir)
    os.environ.setdefault(LAUNCH_ID_VAR, uuid.uuid4().hex if not spec.multi_node else
                          f"{spec.rdzv_id or ''}@{spec.rdzv_endpoint or spec.master_addr}:"
                          f"{spec.master_port or ''}")
    os.environ[LAUNCH_VAR] = spec.described()
    # this launch's directory: what the workers tell the launcher (read after an abort) and
    # NCCL's flight recorder dumps (`torchfrtrace DIRECTORY` says which rank stopped where)
    directory = tempfile.mkdtemp(prefix="tandem-launch-")
    state = os.environ[launch_state.STATE_VAR] = os.path.join(directory, "state.json")
    # NCCL's own error handling unless the user set it: a failed collective aborts the workers
    for var, value in (("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"), ("TORCH_FR_BUFFER_SIZE", "2000"),
                       ("TORCH_NCCL_DUMP_ON_TIMEOUT", "1"),
                       ("TORCH_FR_DUMP_TEMP_FILE", os.path.join(directory, "nccl_trace_rank_"))):
        os.environ.setdefault(var, value)
    if spec.elastic:
        # torch 2.13's workers share the rendezvous' TCPStore, whose master address rank 0
        # writes at its agent's first round only: a newcomer waits for it in vain (torch issue
        # 135712); without sharing, rank 0 writes it at every round
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if spec.rdzv_endpoint:  # the rendezvous numbers the nodes (torchrun's GROUP_RANK)
        os.environ.pop(NODE_VAR, None)
    else:
        os.environ[NODE_VAR] = str(spec.node_rank)
    if route is not None:
        os.environ[ADDR_VAR] = route.local
    os.environ.update(spec.extra_env)
    args = get_args_parser().parse_args(torchrun_argv(
        spec, route.local if route is not None else None,
        route.local == route.remote if route is not None else None))
    if spec.multi_node and not spec.rdzv_endpoint and spec.node_rank > 0:
        _wait_for_master(spec)
    try:
        with quiet_agent(), _waiting_for_nodes(spec):
            run(args)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        if failure.exitcode not in _TOLD:  # else the worker said why in its own line
            print(f"tandem launch: {_failed_line(exc, spec, launch_state.read(state))}",
                  file=sys.stderr, flush=True)
        return _exit_code(failure.exitcode)
    except Exception as exc:
        stopped = _signal_behind(exc, SignalException)
        if stopped is None:
            told = _rendezvous_failure(exc, spec)
            if told is None:
                raise
            print(f"tandem launch: {told}", file=sys.stderr, flush=True)
            return TOLD_EXIT
        # a signal behind another error (torchrun's timing wrapper failing in its own
        # `finally`): the agent stopped the workers with SIGTERM, a saved stop to them
        told = "passed it on" if stopped is exc else "stopped"
        print(f"tandem launch: stopped by {stopped.sigval.name}; the workers were {told}",
              file=sys.stderr, flush=True)
        return 128 + int(stopped.sigval)
    finally:  # read after the workers, then removed (unless NCCL's flight recorder wrote there)
        if not _dumped():
            shutil.rmtree(directory, ignore_errors=True)
    return 0


def _failed_line(exc, spec: LaunchSpec, state: dict) -> str:
    """The line for workers that did not say why they ended (killed, or aborted by NCCL's
    watchdog); after an abort, what the run keeps, as the workers last told."""
    failures = sorted(exc.failures.items(), key=lambda kv: kv[1].timestamp)
    aborted = [r for r, f in failures if f.exitcode == -signal.SIGABRT]
    others = [(r, f) for r, f in failures if f.exitcode != -signal.SIGABRT]
    node = os.environ.get(NODE_VAR) or state.get("node") or "?"
    parts = [f"rank {rank} (node {node}, local rank {failure.local_rank}, pid {failure.pid}) "
             f"{_describe(failure.exitcode)}" for rank, failure in others[:1]]
    if aborted:
        ranks = ", ".join(map(str, aborted))
        cause = "" if others else " by a lost or silent rank on another node"
        parts.append(f"rank{'s' if len(aborted) > 1 else ''} {ranks} aborted (SIGABRT): a "
                     f"collective failed{cause}, and under NCCL the watchdog ends every worker "
                     "that waits on one")
    line = "; ".join(parts) + f"; the job was stopped ({len(failures)} failed worker(s))"
    if not state or not (aborted or any(r == 0 for r, _ in others) or state.get("aborts")):
        return line  # a survivor's own line says what the run keeps
    step, where = state.get("saved_step"), state.get("checkpoint")
    # rank 0 itself told this node what it saved, or another rank did
    heard = "" if state.get("speaker") == 0 else " that this node heard of"
    kept = (f"the last checkpoint{heard} is {where} from step {step} on node 0"
            if step is not None else f"the run has no checkpoint{heard} yet: start it again "
            "(the same command, with --overwrite)")
    line += f"; {kept}"
    if step is not None and state.get("resume"):
        line += f"; continue with: {state['resume']}"
    if _dumped():
        dumps = os.path.dirname(os.environ["TORCH_FR_DUMP_TEMP_FILE"])
        line += f"; NCCL's flight recorder: torchfrtrace {dumps}"
    return line


def _dumped() -> bool:
    """Whether NCCL's flight recorder left its dumps where the workers were told."""
    dumps = os.path.dirname(os.environ.get("TORCH_FR_DUMP_TEMP_FILE", ""))
    return os.path.isdir(dumps) and any(n.startswith("nccl_trace_rank_") for n in os.listdir(dumps))


def _network(spec: LaunchSpec) -> network.Route | None:
    """Several nodes: the route to the master, whose interface the workers get unless the user
    named theirs (one line says which); a loopback master or own address is refused."""
    if not (spec.multi_node or spec.rdzv_endpoint):
        _note_no_name("127.0.0.1")  # one machine: the workers meet on its loopback
        return None
    host, port = spec.master
    route = network.route_to(host, spec.iface)
    flag = "--rdzv-endpoint" if spec.rdzv_endpoint else "--master-addr"
    if spec.multi_node and network.is_loopback(route.remote):
        raise UsageError(f"{flag} {host} is a loopback address ({route.remote}): the other "
                         "nodes cannot reach it; give node 0's address on the network the "
                         f"nodes share (e.g. {flag} 192.0.2.1)")
    if spec.multi_node and network.is_loopback(route.local):
        raise UsageError(f"this machine reaches {host} only through its loopback interface "
                         f"({route.iface}, {route.local}): {flag} must be node 0's address on "
                         "the network the nodes share")
    named = {var: os.environ[var] for var in network.IFACE_VARS if var in os.environ}
    node = f"node {spec.node_rank}" if not spec.rdzv_endpoint else f"node {route.local}"
    if spec.iface is not None or not named:
        os.environ.update(dict.fromkeys(network.IFACE_VARS, route.iface))
        how = "--iface" if spec.iface else f"the interface that reaches {host}:{port}"
        through = f"{route.iface} ({route.local}), {how}; --iface NAME to choose another"
    else:
        through = (", ".join(f"{var}={value}" for var, value in named.items())
                   + f" (as set; {route.iface} reaches {host})")
    print(f"tandem launch: {node}: the workers talk through {through}", flush=True)
    _note_no_name(route.remote)
    return route


def _note_no_name(address: str) -> None:
    """Say that torch's c10d ``err=-3`` warnings are harmless where ``address`` has no name."""
    if not network.has_reverse_name(address):
        print(f"tandem launch: note: {address} has no host name here (no DNS answer): torch's "
              "err=-3 warnings are harmless", flush=True)
        print("hint: torch warns 'The hostname of the client socket cannot be retrieved. "
              "err=-3' at each connection", flush=True)


def _wait_for_master(spec: LaunchSpec) -> None:
    """A node other than 0: wait for node 0's port, saying so every :data:`~.join.SAY_EVERY`
    seconds (torchrun says nothing for ten minutes); past the join timeout, one line, status 4."""
    host, port = spec.master
    bound, started, said = join_timeout(spec), time.monotonic(), 0.0
    while True:
        try:
            with socket.create_connection((host, port), timeout=5):
                return
        except OSError as exc:
            reason = exc.strerror or type(exc).__name__
        waited = time.monotonic() - started
        if waited > bound:
            raise JoinFailed(f"node {spec.node_rank}: node 0 did not answer at {host}:{port} "
                             f"within {bound:.0f} s ({reason.lower()}); start it with the same "
                             f"command and {param('node_rank')} 0, or check {param('master_addr')} "
                             f"and {param('master_port')}")
        if waited - said >= SAY_EVERY:
            said = waited
            print(f"tandem launch: node {spec.node_rank}: waiting for node 0 at {host}:{port} "
                  f"({reason.lower()}, {waited:.0f} s of {bound:.0f})", file=sys.stderr,
                  flush=True)
        time.sleep(0.5)


@contextlib.contextmanager
def _waiting_for_nodes(spec: LaunchSpec):
    """Node 0 of several: a line every :data:`~.join.SAY_EVERY` seconds until the nodes met."""
    if not spec.multi_node or spec.node_rank != 0 or spec.rdzv_endpoint:
        yield
        return
    logger = logging.getLogger(_RDZV_LOGGER)
    level, done, started = logger.getEffectiveLevel(), threading.Event(), time.monotonic()
    host, port = spec.master

    def seen(record: logging.LogRecord) -> bool:  # notes it, and lets nothing extra through
        if "Rendezvous complete" in str(record.msg):
            done.set()
        return record.levelno >= level

    def line() -> str:  # nothing once the nodes have met
        return "" if done.is_set() else (
            f"tandem launch: node 0: waiting for the other nodes at {host}:{port} (--nnodes "
            f"{spec.nnodes}; {time.monotonic() - started:.0f} s of {join_timeout(spec):.0f})")

    logger.addFilter(seen)
    logger.setLevel(min(level, logging.INFO))
    try:
        with every(SAY_EVERY, line):
            yield
    finally:
        logger.removeFilter(seen)
        logger.setLevel(level)


def _rendezvous_failure(exc: BaseException, spec: LaunchSpec) -> str | None:
    """The line for a rendezvous that timed out or could not reach the master, else None."""
    text = str(exc)
    words = ("Timed out", "timed out", "refused", "DistStoreError", "clients joined",
             "wait timeout")
    if spec.master is None or not any(w in text for w in words):
        return None
    host, port = spec.master
    counted = re.search(r"(\d+)/(\d+) clients joined", text)
    here = f": {counted.group(1)} of {counted.group(2)} nodes here" if counted else ""
    return (f"node {spec.node_rank}: the nodes did not meet at {host}:{port} within "
            f"{join_timeout(spec):.0f} s{here} (is every node started with the same --nnodes, "
            "--master-addr and --master-port?)")


def _signal_behind(exc: BaseException, kind: type) -> BaseException | None:
    """The ``kind`` exception that ``exc`` was raised while handling (or from), if any."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kind):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def run_captured(spec: LaunchSpec, timeout: float | None = None) -> subprocess.CompletedProcess:
    """Run ``spec`` under torchrun in a child process (this environment plus ``extra_env``, none
    of :func:`launch`'s additions); past ``timeout``: ``subprocess.TimeoutExpired``."""
    argv = [sys.executable, "-m", "torch.distributed.run", *torchrun_argv(spec)]
    return subprocess.run(argv, env={**os.environ, **spec.extra_env}, capture_output=True,
                          text=True, timeout=timeout)
