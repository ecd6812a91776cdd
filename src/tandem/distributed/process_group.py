"""Join and leave the torch.distributed process group of a torchrun job, one device per worker.

One group carries everything, with the collectives' timeout (``--dist-timeout``), so a dead
peer fails the job instead of hanging it; every rank arrives first (:func:`.join.arrive`). Its
backend is gloo for CPU tensors and NCCL for CUDA ones (the agreements travel on the CPU).
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
    """The one device this worker trains on from the ``--devices`` list: ``cpu`` (shared by
    the machine's workers), else entry ``LOCAL_RANK`` (``--devices cuda:2,3``: worker 1 gets
    ``cuda:3``). A list shorter than the machine's workers is a ``UsageError``."""
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
                f"({param('nproc_per_node')} N)")
        return devices[0]
    if len(devices) == 1 and env.local_world_size == 1:
        return devices[0]
    if env.local_rank >= len(devices):
        raise UsageError(
            f"rank {env.rank}: LOCAL_RANK={env.local_rank} but {param('devices')} lists only "
            f"{len(devices)} {devices[0].type} device(s) ({', '.join(map(str, devices))}); "
            f"give one device per process on this machine ({env.local_world_size})")
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
    """The default group's backend: gloo for CPU tensors, the accelerator's for its own."""
    if device_type == "cpu":
        return "gloo"
    return f"cpu:gloo,{device_type}:{backend_for(torch.device(device_type))}"


def init_process_group(env: DistEnv, device: torch.device, timeout: float | None = None) -> str:
    """Set the current CUDA device (NCCL's collectives and the saved random state go by it) and
    join the job's process group (``env://``), or reuse the one that exists after checking its
    size and rank (:func:`destroy_process_group` leaves only a group made here). Returns
    ``device``'s backend; ``timeout`` defaults to ``env.timeout``."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _join(env, group_backend(device.type), timeout)
    return backend_for(device)


def _join(env: DistEnv, backend: str, timeout: float | None) -> dict | None:
    """Join the default group (``{rank: (node, address)}``), or reuse the one there (``None``)."""
    global _joined, _made_here
    if dist.is_initialized():
        _joined = True  # a group of the caller's: its gloo threads outlive it all the same
        if dist.get_world_size() != env.world_size or dist.get_rank() != env.rank:
            raise RuntimeError(
                f"a process group already exists with rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but torchrun says rank {env.rank} of {env.world_size}")
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
            dist.init_process_group(backend, store=own, rank=env.rank, world_size=env.world_size,
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
        # a TandemError keeps the group: the others must read its line in the store before
        # they meet closed connections (``tandem`` then ends the process)
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
        self.agreement = Agreement(env.rank, env.world_size, node=env.node, addr=env.addr, env=env)
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
    it joined a process group (``tandem.exit``; ``tandem`` itself ends this way): gloo's worker
    threads, never joined, may still take the GIL to free a collective's tensors, and one that
    does while the interpreter finalizes is ended by CPython mid-C++ (SIGABRT)."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    if _joined:
        os._exit(code)
    sys.exit(code)


def release_ddp(wrapped) -> None:
    """Free a ``DistributedDataParallel``'s C++ reducer now, before its groups are destroyed:
    holding a gloo group's last reference, its destructor would join gloo's threads under the
    GIL, which one of them may wait for (a deadlock). The wrapper cannot train afterwards.
    Safe on anything else (no-op) and twice."""
    state = getattr(wrapped, "__dict__", {})
    for name in ("logger", "reducer"):  # the logger holds the reducer too
        state.pop(name, None)


def grads_in_param_strides(model: torch.nn.Module) -> list:
    """Hand DDP every gradient of ``model`` re-viewed (no copy) in its parameter's strides, which
    autograd may not keep on size-1 dims (the same layout) and DDP compares exactly (it warns
    "Grad strides do not match bucket view strides"); returns the hooks' handles."""
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
    """Sum ``tensor`` over every rank into a new tensor on its device; the reduction runs on
    ``device`` (the worker's), as NCCL reduces only CUDA tensors."""
    work = tensor.detach().to(device, copy=True)
    dist.all_reduce(work, op=dist.ReduceOp.SUM, group=None)
    return work.to(tensor.device)


def barrier() -> None:
    """Wait for every rank (in the work group)."""
    dist.barrier(group=None)
