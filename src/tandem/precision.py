"""What ``--amp`` means on a device; a run's plan decides it once (``RunPlan.precision``).

On the CPU, bfloat16 autocast without loss scaling, only with bf16 instructions (else it is
emulated, slower than float32). On CUDA, float16 with a ``GradScaler``, or bfloat16 without.
Weights, gradients, optimizer state and checkpoints stay float32.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch

from tandem.distributed.env import CPU_BF16_VAR
from tandem.errors import UsageError, param

AMP_DTYPES = ("bf16", "fp16")
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 (AVX-512, AMX); aarch64 ("bf16")
_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags from ``/proc/cpuinfo`` (empty where there is none)."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):  # x86, aarch64
                return frozenset(value.split())
    return frozenset()


def cpu_has_bf16() -> bool:
    """Whether this CPU has bf16 instructions (so bf16 autocast beats float32)."""
    return any(flag in cpu_flags() for flag in CPU_BF16_FLAGS)


@dataclass(frozen=True)
class Precision:
    """How a step runs on ``device_type``: autocast to ``dtype`` (``None``: float32 throughout),
    with the loss scaled by a ``GradScaler`` when ``scaled``."""

    device_type: str
    dtype: torch.dtype | None = None
    scaled: bool = False

    def autocast(self):
        """The context a forward (and its loss) runs in."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    @property
    def amp_dtype(self) -> str | None:
        """``--amp-dtype``'s name for ``dtype`` (``None``: float32)."""
        return next((n for n, d in _TORCH_DTYPES.items() if d == self.dtype), None)

    def scaler(self) -> torch.amp.GradScaler:
        """A ``GradScaler`` (a pass-through one when the loss is not scaled)."""
        return torch.amp.GradScaler(self.device_type, enabled=self.scaled)

    def describe(self) -> str:
        if self.dtype is None:
            return "fp32"
        return f"amp {self.amp_dtype}" + (" + grad scaling" if self.scaled else "")


def amp_refusal(device_type: str, amp_dtype: str | None, *, cpu_bf16: bool | None = None
                ) -> UsageError | None:
    """Why ``--amp`` with ``amp_dtype`` cannot run on ``device_type`` (``None``: it can).
    ``cpu_bf16``: take the CPU as computing bf16 (``True``: emulated where it has no bf16
    instructions, what ``TANDEM_CPU_BF16=1`` asks for); ``None``: :func:`cpu_has_bf16`."""
    if amp_dtype is not None and amp_dtype not in AMP_DTYPES:
        return UsageError(f"bad {param('amp_dtype')} {amp_dtype!r}: choose bf16 or fp16")
    if device_type == "cuda":
        return None
    if device_type != "cpu":
        return UsageError(f"{param('amp')} needs a CUDA device or a CPU, not {device_type}")
    if amp_dtype == "fp16":
        return UsageError(f"{param('amp_dtype')} fp16 is for CUDA; {param('amp')} on the CPU "
                          f"is bf16", hint=f"leave {param('amp_dtype')} out")
    if not (cpu_has_bf16() if cpu_bf16 is None else cpu_bf16):
        return UsageError(f"{param('amp')} on the CPU needs bf16 instructions (avx512_bf16 or "
                          f"amx_bf16), which this CPU lacks",
                          hint=f"run without {param('amp')} (float32 is faster here), or set "
                               f"{CPU_BF16_VAR}=1 to run it emulated (slower)")
    return None


def amp_precision(device_type: str, amp: bool, amp_dtype: str | None = None, *,
                  cpu_bf16: bool | None = None) -> Precision:
    """What ``--amp`` (``amp``) with ``--amp-dtype`` (``amp_dtype``, ``None``: the device's
    choice) means on ``device_type``; :func:`amp_refusal`'s error where it cannot run."""
    if not amp:
        return Precision(device_type)
    refusal = amp_refusal(device_type, amp_dtype, cpu_bf16=cpu_bf16)
    if refusal is not None:
        raise refusal
    if device_type == "cuda":
        dtype = amp_dtype or "fp16"
        return Precision(device_type, _TORCH_DTYPES[dtype], scaled=dtype == "fp16")
    return Precision(device_type, torch.bfloat16, scaled=False)


def amp_flags(amp_dtype: str | None) -> str:
    """The flags that ask for ``--amp`` with ``amp_dtype`` (``None``: the device's choice)."""
    return "--amp" + (f" --amp-dtype {amp_dtype}" if amp_dtype else "")
