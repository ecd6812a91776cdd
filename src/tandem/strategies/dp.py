"""``dp``: one process, the model replicated on every device, outputs gathered on device 0.

Built on :class:`tandem.parallel.DataParallel`. With ``sync_bn`` the update equals ``single``'s;
``buffers`` picks whose BN running stats survive a step (``replica0`` or ``average``).
"""

from __future__ import annotations

from torch import nn

from tandem.parallel import DataParallel, convert_sync_batchnorm

from .base import Strategy, register


# Replicas copy the model's attributes, so a compiled ``__call__`` would still run the
# original module; each replica would need its own compiled graph, which is not built yet.
REPLICAS_NOT_COMPILED = "its replica threads would each need their own compiled copy of the model"


def prepare_replicated(strategy: Strategy, model: nn.Module) -> nn.Module:
    """Convert batch norm when ``--sync-bn`` asks for it, then move ``model`` to device 0."""
    if strategy.sync_bn:
        model = convert_sync_batchnorm(model)
    return model.to(strategy.device)


class ReplicatedStrategy(Strategy):
    """One process, replica threads: the ``DataParallel`` cuts each batch by ``split``."""

    splits_batch = True
    replica_threads = True
    compile_unsupported = REPLICAS_NOT_COMPILED

    def wrapper_options(self) -> dict:
        return dict(device_ids=self.devices, output_device=self.device, buffers=self.buffers,
                    split=self.split, backward_threads=self.backward_threads)


@register
class DataParallelStrategy(ReplicatedStrategy):
    name = "dp"

    def setup(self, model: nn.Module) -> nn.Module:
        return DataParallel(prepare_replicated(self, model), **self.wrapper_options())
