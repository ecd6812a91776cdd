"""Join and leave the torch.distributed process group of a torchrun job, one device per worker.

One group carries everything, with the collectives' timeout (``--dist-timeout``), so a dead
peer makes the job fail instead of hang; every rank arrives first (:func:`.join.arrive`, with
the longer join bound). Its backend is gloo for CPU tensors and, with CUDA, NCCL for CUDA ones:
the job's agreements (:mod:`.agree`) travel on the CPU. :class:`Job` joins it once for a run.
"""

from __future__ import annotations

import os
import sys
import time

from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist

from tandem.errors import TandemError, UsageError, param

from . import faults, join
from .agree import LOCAL, Agreement
from .env import DistEnv

_joined = False  # this process has joined a process group (see joined_a_group)
_made_here = False  # the default group now is one init_process_group made (not the caller's)


def pick_device(env: DistEnv, devices: Sequence[torch.device]) -> torch.device:
    """The one device this worker trains on, chosen from the ``--devices`` list.

    - CPU: ``cpu`` (every worker on the machine shares it; one ``cpu`` entry is expected).
    - an accelerator list: entry ``LOCAL_RANK`` of it, so ``--devices cuda`` (every GPU) gives
      ``cuda:LOCAL_RANK`` and ``--devices cuda:2,3`` gives worker 0 ``cuda:2`` and worker 1
      ``cuda:3``. A list shorter than the workers on this machine is a ``ValueError``.
    """
    devices = list(devices)
    if not devices:
        raise UsageError(f"{param('strategy')} ddp needs a device; got an empty device list")
    kinds = {d.type for d in devices}
    if len(kinds) != 1:
        raise UsageError(f"{param('strategy')} ddp needs one kind of device, got {sorted(kinds)}")
    if devices[0].type == "cpu":
        if len(devices) > 1:
            raise UsageError(
                f"{param('strategy')} ddp runs one device per process, got {len(devices)} CPU "
                f"replicas; use {param('devices')} cpu and more processes "
                f"({param('nproc_per_node')} N)"
            )
        return devices[0]
    if len(devices) == 1 and env.local_world_size == 1:
        return devices[0]
    if env.local_rank >= len(devices):
        raise UsageError(
            f"rank {env.rank}: LOCAL_RANK={env.local_rank} but {param('devices')} lists only "
            f"{len(devices)} {devices[0].type} device(s) ({', '.join(map(str, devices))}); "
            f"give one device per process on this machine ({env.local_world_size})"
        )
    return devices[env.local_rank]


def backend_for(device: torch.device) -> str:
    """gloo on the CPU, nccl on CUDA, torch's default backend for other accelerators."""
    if device.type == "cpu":
        return "gloo"
    if device.type == "cuda":
        return "nccl"
    default = getattr(dist, "get_default_backend_for_device", None)
    if default is None:
        raise UsageError(f"no torch.distributed backend known for device {device}")
    return default(device)


def group_backend(device_type: str) -> str:
    """The default group's backend for a job whose devices are of ``device_type``: gloo for
    CPU tensors, and the accelerator's own backend for its tensors."""
    if device_type == "cpu":
        return "gloo"
    return f"cpu:gloo,{device_type}:{backend_for(torch.device(device_type))}"


def init_process_group(env: DistEnv, device: torch.device, timeout: float | None = None) -> str:
    """Join the job's process group (``env://`` rendezvous at MASTER_ADDR:MASTER_PORT), or
    reuse the one that exists (a :class:`Job`'s, or the caller's, after checking its size and
    rank, and left to its maker: :func:`destroy_process_group` leaves only a group made here).

    Sets the current CUDA device first for a CUDA worker (NCCL's collectives and the saved
    random state go by it). Returns the backend of ``device``'s tensors; ``timeout``
    (seconds) defaults to ``env.timeout``.
    """
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _join(env, group_backend(device.type), timeout)
    return backend_for(device)


def _join(env: DistEnv, backend: str, timeout: float | None) -> dict | None:
    """Join the default group, returning where each rank runs (``{rank: (node, address)}``),
    or reuse the one that exists (``None``)."""
    global _joined, _made_here
    if dist.is_initialized():
        _joined = True  # a group of the caller's: its gloo threads outlive it all the same
        if dist.get_world_size() != env.world_size or dist.get_rank() != env.rank:
            raise RuntimeError(
                f"a process group already exists with rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but torchrun says rank {env.rank} of {env.world_size}"
            )
        return None
    seconds = env.timeout if timeout is None else float(timeout)
    bound = max(seconds, env.join_timeout)
    store = join.job_store(env, bound)
    peers = join.arrive(env, store, bound)
    started = time.monotonic()
    try:
        with join.abandoned_if_another_fails(env):
            # the join's own prefix: a dead attempt's keys are not read
            own = dist.PrefixStore(f"{join.key_prefix(env)}/pg{join.joins()}", store)
            dist.init_process_group(backend, store=own,
                                    rank=env.rank, world_size=env.world_size,
                                    timeout=timedelta(seconds=seconds))
    except (RuntimeError, ValueError) as exc:  # DistError subclasses RuntimeError
        raise join.JoinFailed(
            f"rank {env.rank}: every rank came to {env.master_addr}:{env.master_port}, but "
            f"the {backend} connections failed after {time.monotonic() - started:.1f} s: "
            f"{faults.why(exc)}{_loopback_hint(exc)}") from None
    _joined = _made_here = True
    return peers


class Job:
    """The process group of one run, joined once its own checks pass (:meth:`join`) and left
    when the block ends: the run's plan, race and strategy all work in it."""

    def __init__(self):
        self.agreement: Agreement = LOCAL
        self._made = False

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, kind, error, tb) -> None:
        # A run that fails on a mistake of its own (a TandemError) keeps the group: the caller
        # says the line and leaves it in the job's store for the others, who must meet the
        # closed connections after it, not before (``tandem`` then ends the process); a
        # later run in this process reuses the group.
        if self._made and not isinstance(error, TandemError):
            destroy_process_group()
            self._made = False

    def join(self, env: DistEnv | None) -> Agreement:
        """Join the group of the job ``env`` describes (every rank meets here) and return its
        agreement; the same one when called again. ``None`` (one process): joins nothing."""
        if self.agreement is not LOCAL or env is None:
            return self.agreement
        peers = _join(env, group_backend("cuda" if torch.cuda.is_available() else "cpu"), None)
        self._made = peers is not None
        self.agreement = Agreement(env.rank, env.world_size, node=env.node, addr=env.addr,
                                   env=env)
        self.agreement.peers.update(peers or {})
        return self.agreement


def _loopback_hint(exc: BaseException) -> str:
    """What to do when a peer advertised a loopback address to the other machines."""
    if "127." not in str(exc) and "[::1]" not in str(exc):
        return ""
    return ("; a rank gave its loopback address (its host name resolves to 127.0.0.1): "
            "start the job with `tandem launch`, which gives the workers the interface that "
            "reaches the master, or set GLOO_SOCKET_IFNAME")


def joined_a_group() -> bool:
    """True once this process has joined a process group (its gloo threads may outlive it)."""
    return _joined


def exit_process(code: int = 0) -> None:
    """End this process with ``code``: flushed, then without finalizing the interpreter when
    it joined a process group (``tandem.exit``; ``tandem`` itself ends this way).

    Its files are closed by then (checkpoints are written atomically), but gloo's worker
    threads may still be freeing a finished collective's tensors, which takes the GIL; torch
    keeps references to its groups after ``destroy_process_group``, so those threads are not
    joined, and a thread that asks for the GIL while the interpreter finalizes is ended by
    CPython mid-C++ ("terminate called without an active exception", SIGABRT: about one
    2-process ddp run in 20 under load). Skipping finalization leaves nothing to race.
    """
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    if _joined:
        os._exit(code)
    sys.exit(code)


def release_ddp(wrapped) -> None:
    """Free a ``DistributedDataParallel``'s C++ reducer now, before its groups are destroyed.

    Freed later, the reducer can hold a gloo group's last reference; its destructor then joins
    gloo's worker threads while holding the GIL, and a worker that needs the GIL to free a
    finished collective's tensors waits forever (seen at exit under load). Freed here, the
    group's registry still holds it, and ``destroy_process_group`` frees it without the GIL.
    The wrapper cannot train afterwards. Safe on anything else (no-op) and twice.
    """
    state = getattr(wrapped, "__dict__", {})
    for name in ("logger", "reducer"):  # the logger holds the reducer too
        state.pop(name, None)


def grads_in_param_strides(model: torch.nn.Module) -> list:
    """Hand DDP every gradient of ``model`` in its parameter's strides; returns hook handles.

    Autograd may store a gradient whose strides differ from its parameter's on size-1 dims,
    the same memory layout: conv1's ``[16, 1, 3, 3]`` weight on 1-channel input in
    channels-last strides (digits) gets ``(9, 1, 3, 1)`` where the weight has ``(9, 9, 3, 1)``.
    DDP's bucket views take the parameter's strides and DDP compares strides exactly, so it
    warns "Grad strides do not match bucket view strides". A hook that runs as the gradient is
    stored, before DDP reads it, re-views it in the parameter's strides: no copy, same values.
    """
    return [p.register_post_accumulate_grad_hook(_restride_grad)
            for p in model.parameters() if p.requires_grad and 1 in p.shape]


def _restride_grad(param: torch.Tensor) -> None:
    grad = param.grad
    if grad is None or grad.layout != torch.strided or grad.stride() == param.stride():
        return
    if all(a == b or n == 1 for a, b, n in zip(grad.stride(), param.stride(), param.shape)):
        param.grad = grad.as_strided(param.shape, param.stride(), grad.storage_offset())


def destroy_process_group() -> None:
    """Leave the process group that :func:`init_process_group` made, if there is one (safe to
    call twice); a group the caller made is theirs to destroy, and stays."""
    global _made_here
    if _made_here and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _made_here = False


def all_reduce_sum(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Sum ``tensor`` over every rank; return a new tensor on ``tensor``'s device.

    The input is not modified. The reduction runs on ``device`` (the worker's device), because
    NCCL only reduces CUDA tensors; a CPU tensor on a CUDA worker is copied there and back.
    """
    work = tensor.detach().to(device, copy=True)
    dist.all_reduce(work, op=dist.ReduceOp.SUM, group=None)
    return work.to(tensor.device)


def barrier() -> None:
    """Wait for every rank (in the work group)."""
    dist.barrier(group=None)
