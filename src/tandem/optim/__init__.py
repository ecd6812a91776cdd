"""The training recipe's optimizers and what runs around the optimizer step.

LARS and LAMB (:mod:`.lars`, :mod:`.lamb`; torch has SGD and AdamW), the optimizer of a recipe
with weight-decay exclusion and the linear scaling rule (:mod:`.recipe`), gradient clipping by
the whole model's norm (:mod:`.clip`) and an EMA of the weights (:mod:`.ema`). Every norm is
the plain model's, whatever a strategy split (:mod:`tandem.plain_norms`).
"""

from .clip import CLIP_MODES, GradClip
from .ema import ModelEma, ema_decay
from .lamb import LAMB
from .lars import LARS
from .recipe import (EXCLUDES_NORM, LR_SCALES, OPTIMIZERS, create_optimizer, decay_groups,
                     lr_scaled)

__all__ = ["LARS", "LAMB", "GradClip", "ModelEma", "ema_decay", "create_optimizer",
           "decay_groups", "lr_scaled", "OPTIMIZERS", "LR_SCALES", "CLIP_MODES",
           "EXCLUDES_NORM"]
