"""One checkpoint writer and reader for every strategy.

A superset of the imagenet example's dict; ``state_dict`` is the unwrapped model's, with no
``module.``. Writes are atomic; reads are ``weights_only`` and fail as one-line
:class:`CheckpointError`.
"""

from tandem.errors import CheckpointError
from tandem.model_state import load_plain_state_dict, plain_state_dict

from .io import FORMAT, load, load_optimizer_state, load_weights, save
from .rng import capture_rng, restore_rng

__all__ = ["save", "load", "load_weights", "load_optimizer_state", "plain_state_dict",
           "load_plain_state_dict", "capture_rng", "restore_rng", "CheckpointError"]
