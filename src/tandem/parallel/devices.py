"""One home for turning user device specs into ``torch.device`` lists.

Entries may be CUDA ordinals, strings or ``torch.device``; ``"cpu"`` may repeat (one replica
thread each). ``None`` means every CUDA device, or one CPU. A bad entry raises ``ValueError``.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from tandem.errors import UsageError, param

__all__ = ["resolve_devices", "parse_device_spec", "as_device", "index_of"]


def index_of(device: torch.device, devices: Sequence[torch.device]) -> int | None:
    """The position of ``device`` in ``devices`` (first match), or ``None``."""
    for i, d in enumerate(devices):
        if d == device:
            return i
    return None


def as_device(spec) -> torch.device:
    """Turn one device spec (int ordinal, string or ``torch.device``) into a ``torch.device``.

    Raises ``ValueError`` naming ``spec`` when it is not a device, or when it names a CUDA
    ordinal this machine does not have.
    """
    if isinstance(spec, bool):
        raise UsageError(f"bad device {spec!r}: expected an int ordinal, a string or torch.device")
    if isinstance(spec, int):
        if spec < 0:
            raise UsageError(f"bad device {spec!r}: a device ordinal must be >= 0")
        device = torch.device("cuda", spec)
    elif isinstance(spec, (str, torch.device)):
        try:
            device = torch.device(spec)
        except (RuntimeError, ValueError) as exc:
            raise UsageError(f"bad device {spec!r}: {exc}") from None
    else:
        raise UsageError(
            f"bad device {spec!r}: expected an int ordinal, a string or torch.device, "
            f"got {type(spec).__name__}"
        )
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"bad device {spec!r}: CUDA is not available on this machine")
        index = 0 if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise UsageError(
                f"bad device {spec!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
        device = torch.device("cuda", index)
    return device


def resolve_devices(device_ids: Iterable | None) -> list[torch.device]:
    """Resolve a ``device_ids`` argument into a non-empty list of ``torch.device``.

    ``None`` means every CUDA device, or ``[cpu]`` when CUDA is unavailable. Repeats are kept
    (``["cpu", "cpu"]`` is two CPU replicas).
    """
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
    """Parse a device spec (the CLI's ``--devices``); errors name it as parameter ``name``.

    Accepted forms: ``cpu`` (one CPU replica), ``cpu:N`` (N CPU replicas, N >= 1), ``cuda``
    (every CUDA device), ``cuda:0,1`` (those CUDA devices), ``auto`` (every CUDA device, else
    one CPU). Raises ``ValueError`` with a one-line message for anything else.
    """
    name = param(name)
    text = spec.strip().lower()
    kinds = sorted({part.split(":")[0].strip() for part in text.split(",")} & {"cpu", "cuda"})
    if "," in text and len(kinds) > 1:
        raise UsageError(f"bad {name} {spec!r}: one run uses one device type, not "
                         f"{' and '.join(kinds)} together (e.g. cpu:2 or cuda:0,1)")
    if text == "auto":
        return resolve_devices(None)
    if text == "cpu":
        return [torch.device("cpu")]
    if text.startswith("cpu:"):
        count = text[4:]
        if not count.isdigit() or int(count) < 1:
            raise UsageError(f"bad {name} {spec!r}: cpu:N needs N >= 1 (e.g. cpu:2)")
        return [torch.device("cpu")] * int(count)
    if text == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"bad {name} {spec!r}: CUDA is not available on this machine")
        return resolve_devices(None)
    if text.startswith("cuda:"):
        parts = [p for p in text[5:].split(",")]
        if not parts or not all(p.isdigit() for p in parts):
            raise UsageError(f"bad {name} {spec!r}: expected cuda:0,1 (a list of ordinals)")
        return resolve_devices([int(p) for p in parts])
    raise UsageError(f"bad {name} {spec!r}: expected cpu, cpu:N, cuda, cuda:0,1 or auto")


