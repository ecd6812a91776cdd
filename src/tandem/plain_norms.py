"""The norm of a parameter as the plain model sees it, whatever a strategy split it into.

Gradient clipping, LARS and LAMB take norms of whole layers: a strategy that cuts a layer into
blocks (``hybrid``, ``hybrid-ddp``) must sum the blocks' squares before any square root, or the
update is not the one device's. Strategies provide that sum (``Strategy.plain_norms``).
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch


class PlainNorms:
    """Squared norms of tensors shaped like the optimizer's ``params``, one per *plain*
    parameter: ``owners[i]``, the one ``params[i]`` is a piece of; ``spread``, those whose
    pieces lie on several processes, summed by ``reduce`` (in place or returned). Warning:
    with ``spread``, every process must call it alike; a parameter held whole is counted once."""

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
        """``(lists, plain parameters)`` float64 sums of squares, reduced over processes once."""
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
        """For each list of tensors (one per parameter, ``None`` counting 0), each one's plain
        parameter's squared norm, float64 on that parameter's device (``params`` must hold
        every piece of the plain parameters it touches)."""
        params = list(params)
        plain = self._plain(params, tensor_lists)
        owners = [self._owner[id(p)] for p in params]
        return [[row[k].to(p.device) for k, p in zip(owners, params)] for row in plain]

    def total(self, params: Sequence[torch.Tensor],
              tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """The whole model's squared norm of ``tensors`` (one per parameter), float64."""
        return self._plain(list(params), [list(tensors)])[0].sum()


def _square(t: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """``t``'s squared 2-norm, float64 on ``device`` (0 for ``None`` or an empty block)."""
    if t is None or t.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=device)
    return t.detach().double().square().sum().to(device)
