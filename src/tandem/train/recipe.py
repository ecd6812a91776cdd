"""The training recipe of a config (:mod:`tandem.optim`): the optimizer at its scaled lr, the
clip and the EMA, by the plain model's norms, so every strategy computes one device's update."""

from __future__ import annotations

import torch
from torch import nn

from tandem.config import OptimConfig
from tandem.optim import GradClip, ModelEma, create_optimizer, lr_scaled
from tandem.plain_norms import PlainNorms

def images_per_step(cfg: OptimConfig) -> int:
    """The images one optimizer step takes: the global batch times ``--accum-steps``."""
    return cfg.batch_size * cfg.accum_steps


def scaled_lr(cfg: OptimConfig) -> float:
    """``--lr`` scaled by ``--lr-scale`` for :func:`images_per_step` over ``--lr-base-batch``."""
    return lr_scaled(cfg.lr, cfg.lr_scale, images_per_step(cfg), cfg.lr_base_batch)


def lr_line(cfg: OptimConfig) -> str | None:
    """The opening line saying how ``--lr-scale`` set the learning rate (``None``: it did not)."""
    if cfg.lr_scale == "none":
        return None
    images = images_per_step(cfg)
    per_step = (f"-b {cfg.batch_size} x --accum-steps {cfg.accum_steps}"
                if cfg.accum_steps > 1 else f"-b {cfg.batch_size}")
    ratio = f"{images}/{cfg.lr_base_batch}"
    factor = ratio if cfg.lr_scale == "linear" else f"sqrt({ratio})"
    return (f"lr {scaled_lr(cfg):.6g}: --lr {cfg.lr:g} x {factor} (--lr-scale {cfg.lr_scale}: "
            f"{images} images per step, {per_step}, over --lr-base-batch {cfg.lr_base_batch})")


def make_optimizer(cfg: OptimConfig, params, norms: PlainNorms | None = None
                   ) -> torch.optim.Optimizer:
    """The optimizer ``cfg`` names over ``params`` at the scaled learning rate."""
    return create_optimizer(cfg.optimizer, params, lr=scaled_lr(cfg), weight_decay=cfg.weight_decay,
                            momentum=cfg.momentum, nesterov=cfg.nesterov, betas=cfg.betas(),
                            eps=cfg.opt_eps, trust_coefficient=cfg.lars_trust,
                            exclude_norm=cfg.excludes_norm(), norms=norms)


def make_clip(cfg: OptimConfig, norms: PlainNorms) -> GradClip | None:
    """``--clip-grad``'s clip of the gradients of ``norms.params`` (``None`` without it)."""
    return None if cfg.clip_grad is None else GradClip(cfg.clip_grad, cfg.clip_mode, norms)


def make_ema(cfg: OptimConfig, model: nn.Module) -> ModelEma | None:
    """``--model-ema``'s average of ``model`` (``None`` without it)."""
    if cfg.model_ema is None:
        return None
    return ModelEma(model, cfg.model_ema, warmup=cfg.model_ema_warmup)
