"""Plain-torch baselines (no tandem code but :func:`~tandem.strategies.compile.compiled` for
their ``+compile`` twins), timed next to tandem's strategies.

``bare`` is a hand-written step on the first device, so ``single / bare`` is the engine's
overhead. ``torch_dp`` is ``nn.DataParallel`` (CUDA, two or more GPUs only; else skipped).
``torch_ddp`` is plain DDP, one process per device, built in the torchrun phase
(:mod:`tandem_bench.distributed`). Their bytes moved are "not counted".
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.distributed.process_group import release_ddp
from tandem.precision import Precision
from tandem.strategies import compile as compiling

from .contestants import Contestant, TrainStep, place, module_tensors, skipped

BASELINES = ("bare", "torch_dp", "torch_ddp")


def bare_contestant(model: nn.Module, devices: list[torch.device], batch, *, amp: Precision,
                    lr: float, channels_last: bool = False, compiled: bool = False,
                    compile_mode: str | None = None) -> Contestant:
    """The whole global batch through ``model`` on ``devices[0]``, written by hand."""
    device = devices[0]
    model, images, targets = place(model.to(device), *batch, device, channels_last)
    model = compiling.compiled(model, compile_mode) if compiled else model
    criterion = nn.CrossEntropyLoss()
    step = TrainStep(lambda: criterion(model(images), targets), model.parameters(),
                     amp, lr)
    return Contestant(
        name="bare", kind="baseline", devices=[device],
        step=step,
        own_tensors=lambda: module_tensors(model, step.optimizer, images, targets),
    )


def _distinct(devices: list[torch.device]) -> list[torch.device]:
    return [d for i, d in enumerate(devices) if d not in devices[:i]]


def torch_dp_skip_reason(devices: list[torch.device], compiled: bool = False) -> str | None:
    """Why ``torch.nn.DataParallel`` cannot run on ``devices``, or ``None`` when it can."""
    if not all(d.type == "cuda" for d in devices) or len(_distinct(devices)) < 2:
        return "needs CUDA (>=2 GPUs)"
    if compiled:
        return "not compiled: torch's nn.DataParallel copies the module into each replica"
    return None


def torch_dp_contestant(model: nn.Module, devices: list[torch.device], batch, *, amp: Precision,
                        lr: float, channels_last: bool = False) -> Contestant:
    """``torch.nn.DataParallel`` over the distinct CUDA ``devices``, gathering on the first."""
    reason = torch_dp_skip_reason(devices)
    if reason:
        return skipped("torch_dp", "baseline", devices, reason)
    devices = _distinct(devices)
    model, images, targets = place(model.to(devices[0]), *batch, devices[0], channels_last)
    wrapped = nn.DataParallel(model, device_ids=[d.index for d in devices])
    criterion = nn.CrossEntropyLoss()
    step = TrainStep(lambda: criterion(wrapped(images), targets), wrapped.parameters(),
                     amp, lr)
    return Contestant(
        name="torch_dp", kind="baseline", devices=devices, step=step,
        own_tensors=lambda: module_tensors(wrapped, step.optimizer, images, targets),
    )


def torch_ddp_skip_reason(devices: list[torch.device], sync_bn: bool = False) -> str | None:
    """Why torch DDP (+ SyncBatchNorm with ``sync_bn``) cannot run on ``devices``, or ``None``."""
    if sync_bn and not all(d.type == "cuda" for d in devices):
        return "--sync-bn needs CUDA here (torch's nn.SyncBatchNorm is CUDA-only)"
    if len({d.type for d in devices}) != 1:
        return "needs one device type for every process"
    if devices[0].type != "cpu" and len(_distinct(devices)) != len(devices):
        return "needs one distinct GPU per process"
    if not torch.distributed.is_available():
        return "torch.distributed is not available in this build"
    return None


def torch_ddp_contestant(model: nn.Module, device: torch.device, batch, *, amp: Precision, lr: float,
                         channels_last: bool = False, sync_bn: bool = False,
                         compiled: bool = False, compile_mode: str | None = None) -> Contestant:
    """This process's share of ``DistributedDataParallel`` (``nn.SyncBatchNorm`` if ``sync_bn``).

    Must run inside an initialised process group; ``batch`` is this process's shard.
    """
    from torch.nn.parallel import DistributedDataParallel


    if sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model, images, targets = place(model.to(device), *batch, device, channels_last)
    model = compiling.compiled(model, compile_mode) if compiled else model
    device_ids = [device.index] if device.type == "cuda" else None
    wrapped = DistributedDataParallel(model, device_ids=device_ids)
    criterion = nn.CrossEntropyLoss()
    step = TrainStep(lambda: criterion(wrapped(images), targets), wrapped.parameters(),
                     amp, lr)
    return Contestant(
        name="torch_ddp", kind="baseline", devices=[device],
        step=step,
        own_tensors=lambda: module_tensors(wrapped, step.optimizer, images, targets),
        close=lambda: release_ddp(wrapped),
    )
