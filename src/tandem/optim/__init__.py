"""The recipe's optimizers (LARS, LAMB; torch has SGD and AdamW) and what runs around the step:
weight-decay groups and the linear scaling rule, gradient clipping, an EMA of the weights.
Every norm is the plain model's, whatever a strategy split (:mod:`tandem.plain_norms`).
"""

from .clip import CLIP_MODES, GradClip
from .ema import ModelEma, ema_decay
from .lamb import LAMB
from .lars import LARS
from .recipe import (EXCLUDES_NORM, LR_SCALES, OPTIMIZERS, create_optimizer, decay_groups,
                     lr_scaled)

__all__ = ["LARS", "LAMB", "GradClip", "ModelEma", "ema_decay", "create_optimizer",
           "decay_groups", "lr_scaled"]
