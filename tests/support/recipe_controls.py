"""The recipe's negative controls: wrong norms and a wrong EMA, each a context manager that
patches tandem while a run trains (in this process, or in each worker of ``ddp_runs``, which
names them ``recipe_controls:NAME``). Each must move a run far from the one device's update.

- ``norms_per_block``: a split layer's norms taken block by block (hybrid's shards, hybrid-ddp's
  ranks), never summed into the layer's;
- ``norms_summed_over_ranks``: under ddp, every parameter's squares summed over the ranks, as
  if each rank held a block (a replicated gradient counted once per rank);
- ``ema_of_rank_0``: the EMA updated on rank 0 only (every other rank keeps the initial
  weights' average).
"""

from __future__ import annotations

import contextlib
import os
from unittest import mock

from tandem.hybrid import HybridParallel
from tandem.hybrid.across_processes import DistributedHybrid
from tandem.optim import ModelEma
from tandem.plain_norms import PlainNorms
from tandem.strategies import Strategy

__all__ = ["norms_per_block", "norms_summed_over_ranks", "ema_of_rank_0"]


@contextlib.contextmanager
def norms_per_block():
    with mock.patch.object(HybridParallel, "plain_norms",
                           lambda self: PlainNorms(self.parameters(), device=self.output_device)), \
            mock.patch.object(DistributedHybrid, "plain_norms",
                              lambda self, reduce: PlainNorms(self.parameters(),
                                                              device=self.device)):
        yield


@contextlib.contextmanager
def norms_summed_over_ranks():
    def summed(self, wrapped):
        params = list(wrapped.parameters())
        return PlainNorms(params, spread=range(len(params)), reduce=self.all_reduce_sum,
                          device=self.device)

    with mock.patch.object(Strategy, "plain_norms", summed):
        yield


@contextlib.contextmanager
def ema_of_rank_0():
    update = ModelEma.update

    def rank_0_only(self):
        if os.environ.get("RANK", "0") == "0":
            update(self)

    with mock.patch.object(ModelEma, "update", rank_0_only):
        yield
