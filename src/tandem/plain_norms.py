"""The norm of a parameter as the plain model sees it, whatever a strategy split it into.

Gradient clipping takes the norm of the whole model's gradient; LARS and LAMB take, for each
layer, the norms of its weight and of its update. A strategy that cuts a layer into blocks
(``hybrid``'s shards on several devices of one process, ``hybrid-ddp``'s blocks on several
processes) must sum each block's squares into its layer's before any square root, or a norm
is a block's and the update is not the one device's. :class:`PlainNorms` is that sum, and
strategies provide it (``Strategy.plain_norms``): the optimizer's parameters, which plain
parameter each is a piece of, and which plain parameters lie on several processes (their
sums go through one ``reduce``, the processes' sum). A parameter every process holds whole
(a replica's, after DDP's reduction of its gradient) is counted once, never summed over them.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch


class PlainNorms:
    """Squared norms of tensors shaped like the optimizer's parameters (their gradients, the
    weights, an update), one per *plain* parameter.

    ``params``: the trainable parameters as the optimizer holds them; ``owners[i]``: the
    index of the plain parameter ``params[i]`` is a piece of (default: each its own);
    ``spread``: the plain parameters whose pieces lie on several processes, summed over them
    by ``reduce`` (in place or returned); ``device``: where the sums are made (default: the
    first parameter's). Every process must call it alike when ``spread`` is not empty: one
    ``reduce`` per call, whatever the number of tensor lists.
    """

    def __init__(self, params: Iterable[torch.Tensor], owners: Sequence[int] | None = None, *,
                 spread: Iterable[int] = (), reduce: Callable | None = None,
                 device: torch.device | None = None):
        self.params = list(params)
        owners = list(range(len(self.params))) if owners is None else list(owners)
        if len(owners) != len(self.params):
            raise ValueError(f"{len(owners)} owners for {len(self.params)} parameters")
        self._owner = {id(p): k for p, k in zip(self.params, owners)}
        self.count = max(owners, default=-1) + 1  # plain parameters
        self.spread = sorted(set(spread))
        if self.spread and reduce is None:
            raise ValueError("parameters spread over processes need a reduce")
        self.reduce = reduce
        self.device = torch.device(device) if device is not None else (
            self.params[0].device if self.params else torch.device("cpu"))

    def _plain(self, params: Sequence[torch.Tensor],
               tensor_lists: Sequence[Sequence[torch.Tensor | None]]) -> torch.Tensor:
        """``(lists, plain parameters)``: each list's squares summed into the plain
        parameters (float64, on :attr:`device`), reduced over the processes once."""
        index = torch.tensor([self._owner[id(p)] for p in params], dtype=torch.long,
                             device=self.device)
        rows = []
        for tensors in tensor_lists:
            if len(tensors) != len(params):
                raise ValueError(f"{len(tensors)} tensors for {len(params)} parameters")
            local = torch.stack([_square(t, self.device) for t in tensors]) if tensors else \
                torch.zeros(0, dtype=torch.float64, device=self.device)
            rows.append(torch.zeros(self.count, dtype=torch.float64, device=self.device)
                        .index_add_(0, index, local))
        plain = torch.stack(rows) if rows else torch.zeros(0, self.count, dtype=torch.float64)
        if self.spread:  # the blocks other processes hold, added in one collective
            spread = torch.tensor(self.spread, dtype=torch.long, device=self.device)
            part = plain.index_select(1, spread).contiguous()
            summed = self.reduce(part)
            plain = plain.index_copy(1, spread, summed if torch.is_tensor(summed) else part)
        return plain

    def squares(self, params: Sequence[torch.Tensor],
                *tensor_lists: Sequence[torch.Tensor | None]) -> list[list[torch.Tensor]]:
        """For each list of tensors (one per parameter of ``params``, ``None`` counting 0),
        each tensor's plain parameter's squared norm: a float64 0-dim tensor on that
        parameter's device. ``params`` must hold every piece of the plain parameters it
        touches (a layer's blocks are summed only over what is given)."""
        params = list(params)
        plain = self._plain(params, tensor_lists)
        owners = [self._owner[id(p)] for p in params]
        return [[row[k].to(p.device) for k, p in zip(owners, params)] for row in plain]

    def total(self, params: Sequence[torch.Tensor],
              tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """The whole model's squared norm of ``tensors`` (one per parameter of ``params``):
        each plain parameter counted once, float64 on :attr:`device`."""
        return self._plain(list(params), [list(tensors)])[0].sum()


def _square(t: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """``t``'s squared 2-norm in float64 on ``device`` (0 for ``None`` or an empty block)."""
    if t is None or t.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=device)
    return t.detach().double().square().sum().to(device)
