"""tandem.keyed: randomness keyed by sample, so that a run is the same on 1 device or N.

Dropout and drop path draw each sample's mask from a stream keyed by (run seed, optimizer
step, micro-batch, layer, the sample's index in the global batch): :mod:`.keys` (the hashes),
:mod:`.stream` (where a forward stands), :mod:`.dropout` (the layers).
"""

from .dropout import (KEYED_LAYERS, DropPath, KeyedAlphaDropout, KeyedDropout, KeyedDropout1d,
                      KeyedDropout2d, KeyedDropout3d, KeyedFeatureAlphaDropout, drop_path_rates,
                      keyed_dropout)
from .keys import mix_seed
from .stream import step_stream

__all__ = ["keyed_dropout", "step_stream", "DropPath", "drop_path_rates"]

#: ``--dropout-rng``: keyed by sample (the default), or torch's own generator
KEYED, TORCH = "keyed", "torch"
DROPOUT_RNGS = (KEYED, TORCH)
