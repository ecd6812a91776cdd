"""One checkpoint writer and reader for every strategy.

A checkpoint is a dict, a superset of the PyTorch imagenet example's (``epoch``, ``arch``,
``state_dict``, ``best_acc1``, ``optimizer``, ``scheduler``) plus ``format``, ``rng``,
``data_position`` and the resolved ``config``. ``state_dict`` is always the unwrapped model's,
batch-norm buffers in, no ``module.`` prefix. Writes are atomic; reads never unpickle code
(``weights_only=True``) and turn every failure into a one-line :class:`CheckpointError`
naming the file.
"""

from tandem.errors import CheckpointError

from .io import FORMAT, load, save
from .model_state import load_model_state, load_plain_state_dict, plain_state_dict, unwrap
from .rng import capture_rng, restore_rng

__all__ = ["save", "load", "load_model_state", "unwrap", "plain_state_dict",
           "load_plain_state_dict", "capture_rng", "restore_rng", "CheckpointError", "FORMAT"]
