"""``tandem launch``: run a tandem command on many processes and machines with torchrun.

``torch.distributed.run`` starts and watches the workers; we add a free-port check,
``--dist-timeout`` (``TANDEM_DIST_TIMEOUT``), a one-line failure summary and
``TANDEM_LAUNCH_ID`` so restarted workers resume their own run, and keeps torchrun's own
warnings about what tandem reports itself (a Ctrl-C, stopping the workers) off the terminal
(:func:`quiet_agent`). :func:`run_captured` runs a job in a child process and returns its
output instead (the bench's torchrun phase). Two machines::

    tandem launch --nnodes 2 --node-rank R --master-addr HOST0 --master-port 29500 \\
        --nproc-per-node 2 -- train --strategy ddp ...
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import socket
import subprocess
import sys
import uuid
from dataclasses import dataclass, field

from tandem.errors import UsageError

from .env import LAUNCH_ID_VAR, TIMEOUT_VAR

__all__ = ["LaunchSpec", "torchrun_argv", "check_port_free", "quiet_agent", "launch",
           "run_captured"]

_SUBCOMMANDS = ("train", "eval", "bench", "models")

# What torchrun's agent logs as warnings while it stops the workers: a signal it passes on and
# each worker it stops. tandem says both itself ("stopped by SIGINT ...", "the job was
# stopped"), so these lines ("W1123 12:00:00.000 ... Received 2 death signal, shutting down
# workers") are noise. Matched by their message templates: anything else it logs still shows.
_AGENT_LOGGERS = ("torch.distributed.elastic.agent.server.api",
                  "torch.distributed.elastic.multiprocessing.api")
_AGENT_NOISE = frozenset({
    "Received %s death signal, shutting down workers",
    "Got termination signal: %s",
    "Sending process %s closing signal %s",
})


@dataclass(frozen=True)
class LaunchSpec:
    """What ``tandem launch`` was asked to run; ``__post_init__`` rejects what cannot work.

    ``nnodes`` is ``"M"`` or ``"MIN:MAX"`` (elastic); ``master_port`` ``None``/``0`` on one node
    picks a free one. The workers run ``python -m MODULE COMMAND``; with the default module,
    ``tandem``, the command must be one of its subcommands.
    """

    nproc_per_node: int
    command: list[str]
    nnodes: str = "1"
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_backend: str | None = None
    rdzv_id: str | None = None
    max_restarts: int = 0
    dist_timeout: float | None = None
    extra_env: dict = field(default_factory=dict)
    module: str = "tandem"

    def __post_init__(self):
        if self.nproc_per_node < 1:
            raise UsageError(f"bad --nproc-per-node {self.nproc_per_node}: must be >= 1")
        if not self.command:
            raise UsageError("no command to launch: add it after `--`, e.g. "
                             "`tandem launch --nproc-per-node 2 -- train --strategy ddp`")
        if self.module == "tandem" and self.command[0] not in _SUBCOMMANDS:
            raise UsageError(f"cannot launch {self.command[0]!r}: the command after `--` must "
                             f"be a tandem subcommand ({', '.join(_SUBCOMMANDS)})")
        lo, hi = _parse_nnodes(self.nnodes)
        if lo != hi and not self.rdzv_endpoint:
            raise UsageError(f"--nnodes {self.nnodes} (elastic) needs --rdzv-endpoint")
        if self.max_restarts < 0:
            raise UsageError(f"bad --max-restarts {self.max_restarts}: must be >= 0")
        if self.dist_timeout is not None and self.dist_timeout <= 0:
            raise UsageError(f"bad --dist-timeout {self.dist_timeout}: must be > 0 seconds")
        if self.master_port is not None and not 0 <= self.master_port < 65536:
            raise UsageError(f"bad --master-port {self.master_port}: must be 0-65535")
        if self.rdzv_endpoint:
            if self.master_addr or self.master_port:
                raise UsageError("give either --rdzv-endpoint or --master-addr/--master-port, "
                                 "not both")
            return
        if self.rdzv_backend or self.rdzv_id:
            raise UsageError("--rdzv-backend and --rdzv-id need --rdzv-endpoint")
        if not 0 <= self.node_rank < hi:
            raise UsageError(f"bad --node-rank {self.node_rank}: must be in [0, {hi}) "
                             f"for --nnodes {self.nnodes}")
        if hi > 1 and (not self.master_addr or not self.master_port):
            raise UsageError(f"--nnodes {self.nnodes} needs --master-addr and a non-zero "
                             "--master-port (the address and port of node 0), or "
                             "--rdzv-endpoint HOST:PORT")

    @property
    def multi_node(self) -> bool:
        return _parse_nnodes(self.nnodes)[1] > 1


def _parse_nnodes(text: str) -> tuple[int, int]:
    parts = str(text).split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, 0)
    except ValueError:
        lo = hi = 0
    if lo < 1 or hi < lo:
        raise UsageError(f"bad --nnodes {text!r}: expected M or MIN:MAX with 1 <= MIN <= MAX")
    return lo, hi


def check_port_free(addr: str, port: int) -> None:
    """Raise a one-line ``ValueError`` when something on this machine listens on ``port``.

    Racy by nature: a port taken after this check fails in torchrun itself.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise UsageError(f"port {port} on {addr} is already in use; pick another with "
                                 "--master-port") from None
            raise UsageError(f"cannot use port {port} on {addr}: {exc.strerror}") from None


def torchrun_argv(spec: LaunchSpec) -> list[str]:
    """The ``torchrun`` arguments for ``spec``: the workers run ``python -m MODULE COMMAND``."""
    argv = ["--nnodes", str(spec.nnodes), "--nproc-per-node", str(spec.nproc_per_node),
            "--max-restarts", str(spec.max_restarts)]
    if not (spec.rdzv_endpoint or spec.multi_node or spec.master_port):
        # one node, no port given: a free port, chosen by the rendezvous (torchrun's own
        # default in newer torch; older ones take a fixed 29500, which two jobs collide on)
        # and this machine's loopback address for the workers (else its FQDN, which may not
        # resolve where a container names itself)
        argv += ["--standalone", "--local-addr", "127.0.0.1"]
    elif spec.rdzv_endpoint:
        argv += ["--rdzv-backend", spec.rdzv_backend or "c10d",
                 "--rdzv-endpoint", spec.rdzv_endpoint]
        if spec.rdzv_id:
            argv += ["--rdzv-id", spec.rdzv_id]
    else:
        argv += ["--node-rank", str(spec.node_rank),
                 "--master-addr", spec.master_addr or "127.0.0.1"]
        if spec.master_port:
            argv += ["--master-port", str(spec.master_port)]
    return argv + ["-m", spec.module, *spec.command]


def _exit_code(failure_code: int) -> int:
    """A worker's exit code as a process exit status (killed by signal N -> 128 + N)."""
    if failure_code < 0:
        return 128 - failure_code
    return failure_code or 1


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class _DropAgentNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno < logging.ERROR and record.msg in _AGENT_NOISE)


@contextlib.contextmanager
def quiet_agent():
    """Drop torchrun's agent warnings in :data:`_AGENT_NOISE` in this process meanwhile.

    Its errors (a failed worker, one that would not stop) and every other message still show.
    """
    noise = _DropAgentNoise()
    loggers = [logging.getLogger(name) for name in _AGENT_LOGGERS]
    for logger in loggers:
        logger.addFilter(noise)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(noise)


def launch(spec: LaunchSpec) -> int:
    """Run the job described by ``spec`` and return its exit status (0 when every rank did)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    if not spec.rdzv_endpoint and spec.master_port and spec.node_rank == 0:
        check_port_free(spec.master_addr or "127.0.0.1", spec.master_port)
    if spec.dist_timeout is not None:
        os.environ[TIMEOUT_VAR] = str(spec.dist_timeout)
    if spec.nproc_per_node > 1:
        # torchrun would set this too (with a banner): one intra-op thread per worker, so N
        # workers do not fight over the cores. An explicit OMP_NUM_THREADS wins.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    # One id for this launch, the same in restarted workers: they continue its run directory.
    # Every node of a multi-node job must derive the same one.
    os.environ.setdefault(LAUNCH_ID_VAR, uuid.uuid4().hex if not spec.multi_node else
                          f"{spec.rdzv_id or ''}@{spec.rdzv_endpoint or spec.master_addr}:"
                          f"{spec.master_port or ''}")
    if spec.max_restarts > 0:
        # torchrun's shared rendezvous store outlives a restart, and the restarted workers'
        # process group would then read the dead workers' addresses from it and hang in
        # gloo's connect. A store of their own per attempt has no stale keys.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    os.environ.update(spec.extra_env)
    args = get_args_parser().parse_args(torchrun_argv(spec))
    try:
        with quiet_agent():
            run(args)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        print(f"tandem launch: rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) "
              f"{_describe(failure.exitcode)}; the job was stopped "
              f"({len(exc.failures)} failed worker(s))", file=sys.stderr, flush=True)
        return _exit_code(failure.exitcode)
    except Exception as exc:
        stopped = _signal_behind(exc, SignalException)
        if stopped is None:
            raise
        # a signal behind another error: torchrun's timing wrapper, hit by it before its start
        # time was set, failed in its own `finally` (UnboundLocalError), and the agent stopped the
        # workers with SIGTERM, which they take as SIGINT (a stop at the next vote, saved)
        told = "passed it on" if stopped is exc else "stopped"
        print(f"tandem launch: stopped by {stopped.sigval.name}; the workers were {told}",
              file=sys.stderr, flush=True)
        return 128 + int(stopped.sigval)
    return 0


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
    """Run ``spec`` under torchrun in a child process; return its exit status and text output.

    The child gets this process's environment plus ``spec.extra_env``, and none of
    :func:`launch`'s additions. Past ``timeout`` seconds torchrun is killed and
    ``subprocess.TimeoutExpired`` raised.
    """
    argv = [sys.executable, "-m", "torch.distributed.run", *torchrun_argv(spec)]
    return subprocess.run(argv, env={**os.environ, **spec.extra_env}, capture_output=True,
                          text=True, timeout=timeout)
