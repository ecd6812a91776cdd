"""Every random-number state a training run uses, captured and restored (for exact resume)."""

from __future__ import annotations

import random

import numpy as np
import torch
from tandem.errors import UsageError


def _own_cuda(device) -> int:
    """The CUDA device a process trains on (``device``'s index; else the current one)."""
    device = None if device is None else torch.device(device)
    if device is not None and device.type == "cuda" and device.index is not None:
        return device.index
    return torch.cuda.current_device()


def capture_rng(device=None) -> dict:
    """Every RNG state a run uses (CUDA's when initialised); ``device``: the one it trains on,
    whose generator a resumed process takes as its own."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, py_state, gauss_next = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)),
                  "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": {"version": int(version), "state": torch.tensor(py_state, dtype=torch.int64),
                   "gauss_next": gauss_next}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
        state["cuda_current"] = _own_cuda(device)
    return state


def restore_rng(state: dict, device=None) -> None:
    """Restore what :func:`capture_rng` captured (missing parts left alone) for ``device``."""
    if not isinstance(state, dict):
        raise UsageError(f"RNG state must be a dict, got {type(state).__name__}")
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "numpy" in state:
        s = state["numpy"]
        np.random.set_state((s["kind"], np.asarray(s["keys"], dtype=np.int64).astype(np.uint32),
                             int(s["pos"]), int(s["has_gauss"]), float(s["cached_gaussian"])))
    if "python" in state:
        s = state["python"]
        values = s["state"].tolist() if torch.is_tensor(s["state"]) else list(s["state"])
        random.setstate((int(s["version"]), tuple(int(v) for v in values), s["gauss_next"]))
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available():
        for i, s in enumerate(cuda[:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)
        # this process's own device takes the saver's own device's state: rank 0 saves from
        # cuda:0, whose generator went where rank r's on cuda:r did (all seeded alike)
        saver = state.get("cuda_current")
        if saver is not None and saver < len(cuda):
            torch.cuda.set_rng_state(cuda[saver], _own_cuda(device))
