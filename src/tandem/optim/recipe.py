"""The optimizer of a recipe: which one (torch's SGD and AdamW, tandem's LARS and LAMB), its
weight-decay groups (timm's ``param_groups_weight_decay``) and the learning rate's scaling
with the global batch (Goyal et al. 2017; ``sqrt``: Krizhevsky 2014).
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

from tandem.plain_norms import PlainNorms

from .lamb import LAMB
from .lars import LARS

#: what ``--opt`` accepts
OPTIMIZERS = ("sgd", "adamw", "lars", "lamb")
#: what ``--lr-scale`` accepts
LR_SCALES = ("none", "linear", "sqrt")
#: the optimizers whose weight decay skips biases and norm weights unless told otherwise
#: (timm's default for them; SGD keeps the imagenet example's decay on everything)
EXCLUDES_NORM = ("adamw", "lars", "lamb")
#: epsilon when none is given: torch's AdamW's, timm's LAMB's and LARS's
DEFAULT_EPS = {"adamw": 1e-8, "lamb": 1e-6, "lars": 1e-8}


def lr_scaled(lr: float, rule: str, batch: int, base: int) -> float:
    """``lr`` (set for a batch of ``base``) for a global ``batch``: ``× batch / base``, or its
    square root."""
    if rule == "none":
        return lr
    ratio = batch / base
    return lr * (ratio if rule == "linear" else math.sqrt(ratio))


def decay_groups(params: Iterable[torch.Tensor], exclude_norm: bool,
                 excluded: dict | None = None) -> list[dict]:
    """All of ``params`` in one group, or with ``exclude_norm`` those of one dimension or none
    (biases, norm weights: no names needed) in a second with ``weight_decay`` 0 and ``excluded``."""
    params = list(params)
    if not exclude_norm:
        return [{"params": params}]
    decayed = [p for p in params if p.dim() > 1]
    kept = [p for p in params if p.dim() <= 1]
    groups = [{"params": decayed}] if decayed else []
    if kept:
        groups.append({"params": kept, "weight_decay": 0.0, **(excluded or {})})
    return groups


def create_optimizer(name: str, params: Iterable[torch.Tensor], *, lr: float,
                     weight_decay: float = 0.0, momentum: float = 0.9, nesterov: bool = False,
                     betas: tuple[float, float] = (0.9, 0.999), eps: float | None = None,
                     trust_coefficient: float = 0.001, exclude_norm: bool = False,
                     norms: PlainNorms | None = None) -> torch.optim.Optimizer:
    """Optimizer ``name`` (:data:`OPTIMIZERS`) over ``params``, each taking the settings that are
    its own; ``norms``: the plain model's, for LARS and LAMB (default: each parameter whole)."""
    params = list(params)
    eps = DEFAULT_EPS.get(name) if eps is None else eps
    if name == "sgd":
        return torch.optim.SGD(decay_groups(params, exclude_norm), lr=lr, momentum=momentum,
                               weight_decay=weight_decay, nesterov=nesterov)
    if name == "adamw":
        return torch.optim.AdamW(decay_groups(params, exclude_norm), lr=lr, betas=betas,
                                 eps=eps, weight_decay=weight_decay)
    plain = {"trust": False}  # no trust ratio where there is no weight decay
    norms = norms or PlainNorms(params)
    if name == "lars":
        return LARS(decay_groups(params, exclude_norm, plain), lr=lr, momentum=momentum,
                    weight_decay=weight_decay, trust_coefficient=trust_coefficient, eps=eps,
                    norms=norms)
    if name == "lamb":
        return LAMB(decay_groups(params, exclude_norm, plain), lr=lr, betas=betas, eps=eps,
                    weight_decay=weight_decay, norms=norms)
    raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
