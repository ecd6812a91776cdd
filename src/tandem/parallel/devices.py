"""One home for device specs: user specs to ``torch.device`` lists, and device scopes.

Entries may be CUDA ordinals, strings or ``torch.device``; ``"cpu"`` may repeat (one replica
thread each). ``None`` means every CUDA device, or one CPU. A bad entry raises ``UsageError``.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Sequence

import torch

from tandem.errors import UsageError, param


def index_of(device: torch.device, devices: Sequence[torch.device]) -> int | None:
    """The position of ``device`` in ``devices`` (first match), or ``None``."""
    return next((i for i, d in enumerate(devices) if d == device), None)


def cuda_index(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


def device_scope(device: torch.device):
    """``device`` made the current one of its kind (CUDA or another accelerator) meanwhile, so
    that code that allocates on "the" device (``device="cuda"``) lands on the replica's."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    if device.type != "cpu" and device.index is not None and torch.accelerator.is_available() \
            and torch.accelerator.current_accelerator().type == device.type:
        return torch.accelerator.device_index(device.index)
    return contextlib.nullcontext()


def as_device(spec) -> torch.device:
    """One device spec (int ordinal, string or ``torch.device``) as a ``torch.device``; refuses
    a non-device and a CUDA ordinal this machine does not have."""
    if isinstance(spec, bool) or not isinstance(spec, (int, str, torch.device)):
        raise UsageError(f"bad device {spec!r}: expected an int ordinal, a string or "
                         f"torch.device, got {type(spec).__name__}")
    if isinstance(spec, int):
        if spec < 0:
            raise UsageError(f"bad device {spec!r}: a device ordinal must be >= 0")
        device = torch.device("cuda", spec)
    else:
        try:
            device = torch.device(spec)
        except (RuntimeError, ValueError) as exc:
            raise UsageError(f"bad device {spec!r}: {exc}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"bad device {spec!r}: CUDA is not available on this machine")
        index = 0 if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise UsageError(f"bad device {spec!r}: this machine has "
                             f"{torch.cuda.device_count()} CUDA device(s)")
        device = torch.device("cuda", index)
    return device


def resolve_devices(device_ids: Iterable | None) -> list[torch.device]:
    """A ``device_ids`` argument as a non-empty list of ``torch.device``, repeats kept."""
    if device_ids is None:
        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        return [torch.device("cpu")]
    if isinstance(device_ids, (str, int, torch.device)):
        device_ids = [device_ids]
    devices = [as_device(d) for d in device_ids]
    if not devices:
        raise UsageError("device_ids is empty: give at least one device")
    return devices


def parse_device_spec(spec: str, name: str = "devices") -> list[torch.device]:
    """The CLI's ``--devices``: ``cpu``, ``cpu:N`` (N CPU replicas), ``cuda`` (every CUDA
    device), ``cuda:0,1`` or ``auto`` (every CUDA device, else one CPU); errors name ``name``."""
    name = param(name)
    text = spec.strip().lower()
    kinds = sorted({part.split(":")[0].strip() for part in text.split(",")} & {"cpu", "cuda"})
    if "," in text and len(kinds) > 1:
        raise UsageError(f"bad {name} {spec!r}: one run uses one device type, not "
                         f"{' and '.join(kinds)} together (e.g. cpu:2 or cuda:0,1)")
    if text == "cpu" or text.startswith("cpu:"):
        count = "1" if text == "cpu" else text[4:]
        if not count.isdigit() or int(count) < 1:
            raise UsageError(f"bad {name} {spec!r}: cpu:N needs N >= 1 (e.g. cpu:2)")
        return [torch.device("cpu")] * int(count)
    if text == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"bad {name} {spec!r}: CUDA is not available on this machine")
    if text in ("auto", "cuda"):
        return resolve_devices(None)
    if text.startswith("cuda:"):
        parts = text[5:].split(",")
        if not all(p.isdigit() for p in parts):
            raise UsageError(f"bad {name} {spec!r}: expected cuda:0,1 (a list of ordinals)")
        return resolve_devices([int(p) for p in parts])
    raise UsageError(f"bad {name} {spec!r}: expected cpu, cpu:N, cuda, cuda:0,1 or auto")
