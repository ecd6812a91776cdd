"""One checkpoint writer and reader for every strategy.

Format (a dict; a superset of the PyTorch imagenet example's)::

    format          "tandem.checkpoint/1"      tandem_version   "0.1.0"
    epoch, arch, best_acc1                     (None when not given)
    state_dict      the *unwrapped* model's plain state dict, batch-norm buffers included,
                    never a ``module.`` prefix, split layers merged
    optimizer       optimizer.state_dict() or None
    scheduler       scheduler.state_dict() (or the dict given) or None
    rng             torch CPU, CUDA (if initialised), numpy and python ``random`` states
    data_position   e.g. {"epoch": 3, "batch": 120}, when given
    config          the resolved run config (dataclasses and Paths made plain), when given
    ...             any other keyword given to :func:`save`

Everything stored is a tensor, number, string, None or a plain container, so
``torch.load(weights_only=True)`` reads it; :func:`save` refuses anything else with a
``TypeError`` naming the key. Writes are atomic: a temporary file in the same directory is
written, flushed, fsynced and ``os.replace``-d onto ``path``, so an interrupted save leaves
the previous checkpoint intact. Deciding who writes (rank 0 only) is the caller's job.

:func:`load` never unpickles code (``weights_only=True``) and turns every failure (missing,
corrupt, refused, not a checkpoint, does not fit the model, optimizer mismatch) into a
one-line :class:`CheckpointError` naming the file.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import random
import tempfile
import warnings
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from . import __version__, checkpoint_compat

__all__ = ["save", "load", "load_model_state", "unwrap", "plain_state_dict",
           "load_plain_state_dict", "capture_rng", "restore_rng", "CheckpointError", "FORMAT"]

FORMAT = "tandem.checkpoint/1"
_PREFIX = "module."


class CheckpointError(ValueError):
    """A checkpoint cannot be read or does not fit; the message names the file."""


# -- unwrapping ----------------------------------------------------------------------------

def unwrap(model: nn.Module) -> nn.Module:
    """Follow ``.module`` (DataParallel, DataParallelModel, torch DP/DDP...) to the inner model."""
    seen = set()
    while isinstance(getattr(model, "module", None), nn.Module) and id(model) not in seen:
        seen.add(id(model))
        model = model.module
    return model


def _strip_prefix(state: dict) -> dict:
    """Drop ``module.`` prefixes, but only when *every* key has one (as DataParallel saves)."""
    while state and all(isinstance(k, str) and k.startswith(_PREFIX) for k in state):
        state = OrderedDict((k[len(_PREFIX):], v) for k, v in state.items())
    return state


def plain_state_dict(model: nn.Module) -> dict:
    """The state dict of the plain model inside ``model``, whatever wraps it.

    An object with ``plain_state_dict()`` (HybridParallel, which merges its split layers) is
    asked for it; otherwise ``.module`` is followed and ``state_dict()`` taken. Buffers
    (batch-norm running stats) are included; keys carry no ``module.`` prefix.
    """
    m = model
    while True:
        if callable(getattr(m, "plain_state_dict", None)):
            return _strip_prefix(m.plain_state_dict())
        inner = getattr(m, "module", None)
        if not isinstance(inner, nn.Module):
            return _strip_prefix(m.state_dict())
        m = inner


def load_plain_state_dict(model: nn.Module, state: dict) -> None:
    """Load a plain state dict into ``model`` or the object it wraps (strict)."""
    m = model
    while True:
        if callable(getattr(m, "load_plain_state_dict", None)):
            m.load_plain_state_dict(state)
            return
        inner = getattr(m, "module", None)
        if not isinstance(inner, nn.Module):
            m.load_state_dict(state, strict=True)
            return
        m = inner


# -- RNG -----------------------------------------------------------------------------------

def capture_rng() -> dict:
    """Every RNG state a training run uses, as tensors and plain Python values.

    CUDA states are captured only when CUDA is already initialised, so saving never creates
    a CUDA context on every device.
    """
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, py_state, gauss_next = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)),
                  "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": {"version": int(version), "state": torch.tensor(py_state, dtype=torch.int64),
                   "gauss_next": gauss_next},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    """Restore what :func:`capture_rng` captured. Missing parts are left alone.

    CUDA states are restored for as many devices as both the state and this machine have.
    """
    if not isinstance(state, dict):
        raise ValueError(f"RNG state must be a dict, got {type(state).__name__}")
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


# -- saving --------------------------------------------------------------------------------

_SCALARS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
            torch.Size)


def _plain(obj: Any, where: str) -> Any:
    """``obj`` made loadable by ``weights_only=True``, or ``TypeError`` naming ``where``."""
    if isinstance(obj, _SCALARS) or torch.is_tensor(obj):
        return obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = dataclasses.asdict(obj)
    elif isinstance(obj, os.PathLike):
        return os.fspath(obj)
    elif isinstance(obj, np.generic):
        return obj.item()
    elif isinstance(obj, np.ndarray):
        return torch.from_numpy(obj.copy())
    elif hasattr(obj, "__dict__") and type(obj).__name__ == "Namespace":  # argparse
        obj = vars(obj)
    if isinstance(obj, dict):
        out = {k: _plain(v, f"{where}[{k!r}]") for k, v in obj.items()}
        kind = type(obj)
        return kind(out) if kind in (OrderedDict, Counter) else out
    if isinstance(obj, (list, tuple, set, frozenset)):
        items = [_plain(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        return type(obj)(items) if type(obj) in (list, tuple, set) else list(items)
    raise TypeError(f"cannot store {where} in a checkpoint: {type(obj).__name__} is not a "
                    f"tensor, number, string or plain container")


def _state_of(obj: Any) -> Any:
    return obj.state_dict() if callable(getattr(obj, "state_dict", None)) else obj


def save(path, model: nn.Module, optimizer=None, *, epoch: int | None = None,
         arch: str | None = None, best_acc1: float | None = None, scheduler=None,
         config=None, data_position=None, rng: bool | dict = True, **extra) -> Path:
    """Atomically write a checkpoint of the unwrapped ``model`` to ``path``; return the path.

    ``rng=True`` captures the RNG states now, a dict stores the states given (captured
    earlier), ``False`` stores none. Parent directories are created.
    """
    path = Path(path)
    ckpt: dict[str, Any] = {
        "format": FORMAT, "tandem_version": __version__,
        "epoch": epoch, "arch": arch, "best_acc1": best_acc1,
        "state_dict": plain_state_dict(model),
        "optimizer": None if optimizer is None else optimizer.state_dict(),
        "scheduler": None if scheduler is None else _state_of(scheduler),
    }
    if rng is True:
        ckpt["rng"] = capture_rng()
    elif isinstance(rng, dict):
        ckpt["rng"] = rng
    if data_position is not None:
        ckpt["data_position"] = data_position
    if config is not None:
        ckpt["config"] = config
    reserved = set(ckpt) | {"rng", "data_position", "config"}
    for key, value in extra.items():
        if key in reserved:
            raise TypeError(f"checkpoint key {key!r} is reserved")
        ckpt[key] = value
    ckpt = {k: _plain(v, k) for k, v in ckpt.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(ckpt, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(path.parent)
    return path


def _fsync_dir(directory: Path) -> None:
    """Make the rename durable (best effort: not every OS/filesystem allows it)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# -- loading -------------------------------------------------------------------------------

def _one_line(exc: BaseException) -> str:
    """A short one-line reason from a (possibly long, multi-line) exception message."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    for ln in lines:  # torch's weights_only refusal hides the reason among advice
        low = ln.lower()
        if "unsupported global" in low or "unsupported operand" in low:
            return ln[:200]
    if not lines:
        return type(exc).__name__
    first = lines[0]
    cut = first.find(". ")
    return (first[:cut] if cut > 0 else first)[:200]


def _shape(t) -> str:
    return "[" + ",".join(str(d) for d in t.shape) + "]" if torch.is_tensor(t) else type(t).__name__


def _fit_report(state: dict, model: nn.Module) -> str | None:
    """``None`` when ``state`` fits ``model``, else a one-line summary of what does not."""
    expected = plain_state_dict(model)
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    mismatched = [k for k in expected if k in state and torch.is_tensor(expected[k])
                  and (not torch.is_tensor(state[k]) or state[k].shape != expected[k].shape)]
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing key{'s' * (len(missing) > 1)} (e.g. {missing[0]})")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected key{'s' * (len(unexpected) > 1)} "
                     f"(e.g. {unexpected[0]})")
    if mismatched:
        k = mismatched[0]
        parts.append(f"{len(mismatched)} shape mismatch{'es' * (len(mismatched) > 1)} "
                     f"({k}: checkpoint {_shape(state[k])} vs model {_shape(expected[k])})")
    return ", ".join(parts) or None


def _read(path: Path, map_location) -> dict:
    if not path.exists():
        raise CheckpointError(f"checkpoint '{path}' does not exist")
    if path.is_dir():
        hint = path / "checkpoint.pt"
        raise CheckpointError(f"checkpoint '{path}' is a directory"
                              + (f" (did you mean '{hint}'?)" if hint.is_file() else ""))
    if path.stat().st_size == 0:
        raise CheckpointError(f"checkpoint '{path}' is empty (0 bytes)")
    try:
        with warnings.catch_warnings():  # e.g. "Detected pickle protocol 4": noise for users
            warnings.simplefilter("ignore")
            obj = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        if "global" in str(exc).lower():  # a class or function the safe loader will not build
            raise CheckpointError(
                f"checkpoint '{path}' was refused: it holds objects other than tensors and "
                f"plain data, which could run code ({_one_line(exc)})") from None
        raise CheckpointError(f"checkpoint '{path}' is corrupt or unreadable "
                              f"(UnpicklingError: {_one_line(exc)})") from None
    except Exception as exc:  # truncated zip, garbage bytes, EOF, a directory...
        raise CheckpointError(f"checkpoint '{path}' is corrupt or unreadable "
                              f"({type(exc).__name__}: {_one_line(exc)})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"checkpoint '{path}' holds a {type(obj).__name__}, not a "
                              f"checkpoint dict or state dict")
    if "state_dict" in obj:
        ckpt = dict(obj)
    elif obj and all(isinstance(k, str) and torch.is_tensor(v) for k, v in obj.items()):
        ckpt = {"state_dict": obj}  # a bare state dict, e.g. torch.save(model.state_dict())
    else:
        keys = ", ".join(str(k) for k in list(obj)[:5]) or "none"
        raise CheckpointError(f"checkpoint '{path}' is not a checkpoint: no 'state_dict' and not "
                              f"a state dict (keys: {keys})")
    if not isinstance(ckpt["state_dict"], dict):
        raise CheckpointError(f"checkpoint '{path}': 'state_dict' is a "
                              f"{type(ckpt['state_dict']).__name__}, not a dict")
    return checkpoint_compat.normalise(ckpt)  # wrapper prefixes anywhere, best_prec1


def load(path, model: nn.Module | None = None, optimizer=None, map_location="cpu") -> dict:
    """Read a checkpoint safely; load it into ``model`` and ``optimizer`` when given.

    Accepts tandem checkpoints, imagenet-example dicts (old and new) and bare state dicts;
    DataParallel's ``module.`` in the keys, on the model or any submodule, is stripped in the
    returned ``state_dict`` and ``best_acc1`` is a float (see :mod:`tandem.checkpoint_compat`). The
    model may be wrapped (DataParallel, DDP, HybridParallel...). A checkpoint without
    optimizer state leaves ``optimizer`` untouched. Returns the checkpoint dict; RNG states
    are *not* restored here (call :func:`restore_rng` with ``ckpt["rng"]`` when resuming).
    """
    path = Path(path)
    ckpt = _read(path, map_location)
    if model is not None:
        load_model_state(model, ckpt, path)
    if optimizer is not None and ckpt.get("optimizer") is not None:
        try:
            optimizer.load_state_dict(ckpt["optimizer"])
        except Exception as exc:
            raise CheckpointError(f"checkpoint '{path}': optimizer state does not fit the "
                                  f"optimizer ({_one_line(exc)})") from None
    return ckpt


def load_model_state(model: nn.Module, ckpt: dict, path) -> None:
    """Load the weights of ``ckpt`` (read by :func:`load` from ``path``) into ``model``."""
    report = _fit_report(ckpt["state_dict"], model)
    if report:
        raise CheckpointError(f"checkpoint '{path}' does not fit the model: {report}")
    try:
        load_plain_state_dict(model, ckpt["state_dict"])
    except Exception as exc:
        raise CheckpointError(f"checkpoint '{path}' does not fit the model: "
                              f"{_one_line(exc)}") from None
