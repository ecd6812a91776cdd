"""``dp``: one process, the model replicated on every device, outputs gathered on device 0.

Built on :class:`tandem.parallel.DataParallel`: the global batch is scattered over
``devices``, each replica runs in its own thread, the outputs are gathered on ``devices[0]``
where the loss is computed, and gradients from every replica sum into the one set of
parameters. With ``sync_bn`` every ``BatchNorm`` becomes :class:`~tandem.parallel.SyncBatchNorm`
(statistics over the whole global batch), which makes the update equal to ``single``'s.
``buffers`` picks whose batch-norm running statistics survive a step (``replica0`` or a
chunk-weighted ``average``).
"""

from __future__ import annotations

from torch import nn

from tandem.parallel import DataParallel, convert_sync_batchnorm

from .base import Strategy, register

__all__ = ["DataParallelStrategy", "prepare_replicated", "REPLICAS_NOT_COMPILED"]

# Replicas copy the model's attributes, so a compiled ``__call__`` would still run the
# original module; each replica would need its own compiled graph, which is not built yet.
REPLICAS_NOT_COMPILED = "its replica threads would each need their own compiled copy of the model"


def prepare_replicated(strategy: Strategy, model: nn.Module) -> nn.Module:
    """Convert batch norm when ``--sync-bn`` asks for it, then move ``model`` to device 0."""
    if strategy.sync_bn:
        model = convert_sync_batchnorm(model)
    return model.to(strategy.device)


@register
class DataParallelStrategy(Strategy):
    name = "dp"
    compile_unsupported = REPLICAS_NOT_COMPILED

    def setup(self, model: nn.Module) -> nn.Module:
        return DataParallel(prepare_replicated(self, model), device_ids=self.devices,
                            output_device=self.device, buffers=self.buffers)
