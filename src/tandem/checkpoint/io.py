"""Writing a checkpoint atomically (an interrupted save leaves the previous one intact) and
reading one with ``weights_only=True``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import secrets
import warnings
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch
from torch import nn

from tandem.version import __version__
from tandem.errors import CheckpointError, a
from tandem.model_state import load_plain_state_dict, plain_state_dict

from . import compat
from .rng import capture_rng

FORMAT = "tandem.checkpoint/1"
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
        return type(obj)(out) if type(obj) in (OrderedDict, Counter) else out
    if isinstance(obj, (list, tuple, set, frozenset)):
        items = [_plain(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        return type(obj)(items) if type(obj) in (list, tuple, set) else list(items)
    raise TypeError(f"cannot store {where} in a checkpoint: {type(obj).__name__} is not a "
                    f"tensor, number, string or plain container")


def _state_of(obj: Any) -> Any:  # an optimizer or scheduler, or its state dict
    return obj.state_dict() if callable(getattr(obj, "state_dict", None)) else obj


def save(path, model: nn.Module | Mapping, optimizer=None, *, epoch: int | None = None,
         arch: str | None = None, best_acc1: float | None = None, scheduler=None,
         config=None, data_position=None, rng: bool | dict = True, **extra) -> Path:
    """Atomically write a checkpoint of the unwrapped ``model`` (or a state dict) to ``path``;
    ``rng``: ``True`` captures now, a dict stores those states, ``False`` none."""
    path = Path(path)
    ckpt: dict[str, Any] = {
        "format": FORMAT, "tandem_version": __version__,
        # a 0-dim tensor, as the imagenet example saves it: its --gpu resume calls .to(gpu)
        "epoch": epoch, "arch": arch,
        "best_acc1": None if best_acc1 is None else torch.tensor(float(best_acc1)),
        "state_dict": dict(model) if isinstance(model, Mapping) else plain_state_dict(model),
        "optimizer": None if optimizer is None else _state_of(optimizer),
        "scheduler": None if scheduler is None else _state_of(scheduler)}
    if rng is True:
        rng = capture_rng()
    optional = {"rng": rng if isinstance(rng, dict) else None, "data_position": data_position,
                "config": config}
    reserved = set(ckpt) | set(optional)
    ckpt.update((key, value) for key, value in optional.items() if value is not None)
    for key, value in extra.items():
        if key in reserved:
            raise TypeError(f"checkpoint key {key!r} is reserved")
        ckpt[key] = value
    ckpt = {k: _plain(v, k) for k, v in ckpt.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _create_temp(path)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(ckpt, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)
    return path


def _create_temp(path: Path) -> tuple[int, str]:
    """A new temporary file beside ``path``, mode 0666 less the umask (``mkstemp``'s 0600
    would hide the checkpoint from teammates on a shared cluster)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    for _ in range(100):
        tmp = os.path.join(path.parent, f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside '{path}'")


def _fsync_dir(directory: Path) -> None:
    """Make the rename durable (best effort: not every OS/filesystem allows it)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _read(path: Path, map_location) -> dict:
    if not path.exists():
        raise CheckpointError(f"checkpoint '{path}' does not exist")
    if path.is_dir():
        inside = sorted(p.name for p in path.glob("*.pt*") if p.is_file())[:4]
        raise CheckpointError(f"checkpoint '{path}' is a directory"
                              + (f" (it holds {', '.join(inside)})" if inside else ""))
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
                f"plain data, which could run code ({reason(exc)})") from None
        raise CheckpointError(f"checkpoint '{path}' is corrupt or unreadable "
                              f"(UnpicklingError: {reason(exc)})") from None
    except Exception as exc:  # truncated zip, garbage bytes, EOF, a directory...
        raise CheckpointError(f"checkpoint '{path}' is corrupt or unreadable "
                              f"({type(exc).__name__}: {reason(exc)})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"checkpoint '{path}' holds {a(type(obj).__name__)}, not a "
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
    return compat.normalise(ckpt)  # wrapper prefixes anywhere, best_prec1


def load(path, model: nn.Module | None = None, optimizer=None, map_location="cpu") -> dict:
    """Read a checkpoint safely (tandem's, the imagenet example's, a bare state dict); load it
    into ``model`` and ``optimizer`` when given. RNG states are *not* restored here
    (:func:`restore_rng` with ``ckpt["rng"]``)."""
    path = Path(path)
    ckpt = _read(path, map_location)
    if model is not None:
        load_weights(model, ckpt["state_dict"], path)
    if optimizer is not None:
        load_optimizer_state(optimizer, ckpt, path)
    return ckpt


def load_weights(model: nn.Module, state: dict, path,
                 load: Callable[[nn.Module, dict], None] = load_plain_state_dict) -> None:
    """``load(model, state)`` (default: into the plain model); a misfit is a
    :class:`CheckpointError` naming ``path``."""
    try:
        load(model, state)
    except ValueError as exc:
        raise CheckpointError(f"checkpoint '{path}' does not fit the model: {exc}") from None


def reason(exc: BaseException) -> str:
    """A short one-line reason from a (possibly long) exception message."""
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


def load_optimizer_state(optimizer, ckpt: dict, path, load: Callable | None = None) -> None:
    """Load ``ckpt``'s optimizer state, if any, into ``optimizer`` (or by ``load(state)``: a
    strategy's, for the plain layout checkpoints hold)."""
    if ckpt.get("optimizer") is None:
        return
    try:
        (load or optimizer.load_state_dict)(ckpt["optimizer"])
    except Exception as exc:
        raise CheckpointError(f"checkpoint '{path}': optimizer state does not fit the "
                              f"optimizer ({reason(exc)})") from None
