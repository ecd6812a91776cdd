"""``dp``: one process, the model replicated on every device, outputs gathered on device 0.

Built on :class:`tandem.parallel.DataParallel`. With ``sync_bn`` the update equals ``single``'s;
``buffers`` picks whose BN running stats survive a step (``replica0`` or ``average``).
"""

from __future__ import annotations

from torch import nn

from tandem.parallel import DataParallel, convert_sync_batchnorm

from .base import Strategy, register

__all__ = ["DataParallelStrategy", "ReplicatedStrategy", "prepare_replicated",
           "REPLICAS_NOT_COMPILED"]

# Replicas copy the model's attributes, so a compiled ``__call__`` would still run the
# original module; each replica would need its own compiled graph, which is not built yet.
REPLICAS_NOT_COMPILED = "its replica threads would each need their own compiled copy of the model"


def prepare_replicated(strategy: Strategy, model: nn.Module) -> nn.Module:
    """Convert batch norm when ``--sync-bn`` asks for it, then move ``model`` to device 0."""
    if strategy.sync_bn:
        model = convert_sync_batchnorm(model)
    return model.to(strategy.device)


def replicas_of(wrapped: nn.Module) -> DataParallel | None:
    """The ``DataParallel`` that splits the batch: ``wrapped`` itself or hybrid's trunk."""
    if isinstance(wrapped, DataParallel):
        return wrapped
    trunk = getattr(wrapped, "trunk", None)
    return trunk if isinstance(trunk, DataParallel) else None


class ReplicatedStrategy(Strategy):
    """One process, replica threads: the shares are the ``DataParallel``'s (``split``)."""

    splits_batch = True
    compile_unsupported = REPLICAS_NOT_COMPILED

    def wrapper_options(self) -> dict:
        return dict(device_ids=self.devices, output_device=self.device, buffers=self.buffers,
                    split=self.split, max_share=self.max_share,
                    backward_threads=self.backward_threads)

    def shares(self, wrapped: nn.Module) -> tuple[float, ...] | None:
        dp = replicas_of(wrapped)
        return None if dp is None else dp.weights()

    def rebalance(self, wrapped: nn.Module, epoch: int, batch: int, ahead: int) -> bool:
        # DataParallel adjusts after each timed forward; report a change once, here
        dp = replicas_of(wrapped)
        if dp is not None and dp.auto is not None:
            dp.auto.at_epoch(epoch)  # a new epoch: adjust after its first forward
        now = None if dp is None else dp.weights()
        moved = now != getattr(self, "_shown", now)
        self._shown = now
        return moved

    def split_state(self, wrapped: nn.Module) -> dict | None:
        dp = replicas_of(wrapped)
        return None if dp is None or dp.auto is None else {"auto": dp.auto.state_dict()}

    def load_split_state(self, wrapped: nn.Module, state: dict | None) -> None:
        dp = replicas_of(wrapped)
        if state and dp is not None and dp.auto is not None:
            dp.auto.load_state_dict(state["auto"])
            self._shown = dp.weights()


@register
class DataParallelStrategy(ReplicatedStrategy):
    name = "dp"

    def setup(self, model: nn.Module) -> nn.Module:
        return DataParallel(prepare_replicated(self, model), **self.wrapper_options())
