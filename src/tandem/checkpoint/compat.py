"""Reading checkpoints that other programs wrote, chiefly the PyTorch imagenet example."""

from __future__ import annotations

import torch

from tandem.state_keys import strip_wrappers

# A scheduler's class, told from the keys of its state dict (first match wins).
_SCHEDULER_KEYS = (
    ("lr_lambdas", "LambdaLR"), ("_schedulers", "SequentialLR/ChainedScheduler"),
    ("step_size", "StepLR"), ("milestones", "MultiStepLR"), ("T_0", "CosineAnnealingWarmRestarts"),
    ("T_max", "CosineAnnealingLR"), ("total_steps", "OneCycleLR"), ("max_lrs", "CyclicLR"),
    ("patience", "ReduceLROnPlateau"), ("power", "PolynomialLR"), ("start_factor", "LinearLR"),
    ("factor", "ConstantLR"), ("gamma", "ExponentialLR"))


def is_tandem(ckpt: dict) -> bool:
    """True when tandem wrote ``ckpt`` (it then carries tandem's ``format`` tag)."""
    return str(ckpt.get("format", "")).startswith("tandem.checkpoint/")


def best_accuracy(ckpt: dict) -> float | None:
    """``best_acc1`` (or the older ``best_prec1``) as a float; a tensor is read out."""
    value = ckpt.get("best_acc1")
    if value is None:
        value = ckpt.get("best_prec1")
    if torch.is_tensor(value):
        value = value.float().item() if value.numel() == 1 else None
    return None if value is None else float(value)


def tandem_scheduler(ckpt: dict) -> dict | None:
    """tandem's per-step schedule state: ``tandem_scheduler`` (older files: ``scheduler``)."""
    if not is_tandem(ckpt):
        return None
    state = ckpt.get("tandem_scheduler")
    if state is None and isinstance(ckpt.get("scheduler"), dict) \
            and "lr_lambdas" in ckpt["scheduler"]:
        state = ckpt["scheduler"]
    return state


def foreign_scheduler(ckpt: dict) -> str | None:
    """The kind of another program's scheduler state, which tandem cannot load, else None."""
    state = ckpt.get("scheduler")
    if not isinstance(state, dict) or is_tandem(ckpt):
        return None
    return next((name for key, name in _SCHEDULER_KEYS if key in state), "unknown scheduler")


def final_layer(state: dict) -> tuple[str, int] | None:
    """``(prefix, outputs)`` of the last 2-D ``*.weight`` (the classifier), e.g. ``("fc", 1000)``."""
    last = None
    for key, value in state.items():
        if isinstance(key, str) and key.endswith(".weight") and torch.is_tensor(value) \
                and value.dim() == 2:
            last = (key[:-len(".weight")], int(value.shape[0]))
    return last


def normalise(ckpt: dict) -> dict:
    """A checkpoint dict with plain model keys (no ``module.``) and ``best_acc1`` (or the older
    ``best_prec1``) a float or None; every file read goes through it."""
    ckpt = dict(ckpt)
    ckpt["state_dict"] = strip_wrappers(ckpt["state_dict"])
    if "best_acc1" in ckpt or "best_prec1" in ckpt:
        ckpt["best_acc1"] = best_accuracy(ckpt)
    return ckpt
