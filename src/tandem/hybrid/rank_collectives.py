"""Moving a hybrid head's activations between processes, with autograd: three layouts, three moves.

Rank ``r`` owns ``shares[r]`` rows of an ``(N, F)`` activation (rank order; a share may be 0)
and holds one of: *batch*, its rows ``(shares[rank], F)``; *whole*, ``(N, F)``; *columns*,
``(N, cols[rank])``, or *partial*, ``(N, F)`` terms of a sum over ranks. :func:`gather_rows`
(batch -> whole; backward reduce-scatter), :func:`sum_rows` (partial -> batch; backward
all-gather), :func:`rows_of_columns` (columns -> batch; all-to-all both ways). Rows are padded
to the largest share (gloo gathers equal pieces only). Every rank calls them in the same order
on the same group; each records the bytes this rank sends in :mod:`tandem.parallel.traffic`.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from ..parallel import traffic
from ._shards import ACTIVATION_GRADS, ACTIVATIONS


# torch 2.13 names these ``*_single`` and warns at the older names, which older torch has alone
_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def reduce_scatter_factor(backend: str) -> int:
    """What a reduce-scatter sends over what it hands on: gloo runs it as an all-reduce, twice."""
    return 2 if backend == "gloo" else 1


def all_shares(count: int, device: torch.device, group=None) -> list[int]:
    """Every rank's row count, given this rank's (a small all-gather, read on the host)."""
    world = dist.get_world_size(group)
    mine = torch.tensor([count], dtype=torch.int64, device=device)
    every = torch.empty(world, dtype=torch.int64, device=device)
    _gather_into(every, mine, group=group)
    return [int(c) for c in every.tolist()]


def _padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x.contiguous()
    out = x.new_zeros((rows, *x.shape[1:]))
    out[: x.shape[0]] = x
    return out


def _row_bytes(x: torch.Tensor) -> int:
    return int(torch.Size(x.shape[1:]).numel()) * x.element_size()


def _all_gather(x: torch.Tensor, shares: Sequence[int], group, kind: str | None) -> torch.Tensor:
    """Every rank's rows (``x``: this rank's), concatenated in rank order: ``(sum(shares), ...)``;
    recorded as ``kind`` (``None``: not recorded)."""
    world, most = len(shares), max(shares)
    out = x.new_empty((world * most, *x.shape[1:]))
    _gather_into(out, _padded(x, most), group=group)
    if kind is not None:
        traffic.record(kind, (world - 1) * most * _row_bytes(x))
    return torch.cat([out[r * most: r * most + n] for r, n in enumerate(shares)])


def _reduce_scatter(y: torch.Tensor, shares: Sequence[int], rank: int, group,
                    kind: str) -> torch.Tensor:
    """This rank's rows of the sum over ranks of ``y`` (``(sum(shares), ...)`` on each rank)."""
    world, most = len(shares), max(shares)
    pieces = y.split(list(shares))
    stacked = torch.cat([_padded(p, most) for p in pieces])  # (world * most, ...)
    out = y.new_empty((most, *y.shape[1:]))
    _reduce_scatter_into(out, stacked, op=dist.ReduceOp.SUM, group=group)
    traffic.record(kind, reduce_scatter_factor(dist.get_backend(group)) * (world - 1) * most
                   * _row_bytes(y))
    return out[: shares[rank]]


def _exchange(blocks: Sequence[torch.Tensor], shapes: Sequence[tuple], rank: int,
              group, kind: str) -> list[torch.Tensor]:
    """All-to-all: ``blocks[r]`` to rank ``r``, a block of ``shapes[r]`` from each (flattened:
    blocks of different widths travel in one call)."""
    send = torch.cat([b.reshape(-1) for b in blocks])
    sizes_in = [b.numel() for b in blocks]
    sizes_out = [int(torch.Size(s).numel()) for s in shapes]
    recv = send.new_empty(sum(sizes_out))
    dist.all_to_all_single(recv, send, sizes_out, sizes_in, group=group)
    traffic.record(kind, (sum(sizes_in) - sizes_in[rank]) * send.element_size())
    return [part.view(s) for part, s in zip(recv.split(sizes_out), shapes)]


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shares, rank, group):
        ctx.shares, ctx.rank, ctx.group = shares, rank, group
        return _all_gather(x, shares, group, ACTIVATIONS)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.shares, ctx.rank, ctx.group, ACTIVATION_GRADS), \
            None, None, None


class _SumRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, shares, rank, group):
        ctx.shares, ctx.group = shares, group
        return _reduce_scatter(y, shares, rank, group, ACTIVATIONS)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.shares, ctx.group, ACTIVATION_GRADS), None, None, None


class _RowsOfColumns(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, shares, cols, rank, group):
        ctx.shares, ctx.cols, ctx.rank, ctx.group = shares, cols, rank, group
        mine = shares[rank]
        blocks = _exchange(h.split(list(shares)), [(mine, c) for c in cols], rank, group,
                           ACTIVATIONS)
        return torch.cat(blocks, 1)  # (mine, sum(cols))

    @staticmethod
    def backward(ctx, grad):
        shares, cols, rank = ctx.shares, ctx.cols, ctx.rank
        blocks = _exchange(grad.split(list(cols), 1), [(n, cols[rank]) for n in shares], rank,
                           ctx.group, ACTIVATION_GRADS)
        return torch.cat(blocks), None, None, None, None


def gather_rows(x: torch.Tensor, shares: Sequence[int], rank: int, group=None) -> torch.Tensor:
    """Batch -> whole: ``(shares[rank], F)`` here, ``(N, F)`` out, the same on every rank."""
    return _GatherRows.apply(x, list(shares), rank, group)


def sum_rows(y: torch.Tensor, shares: Sequence[int], rank: int, group=None) -> torch.Tensor:
    """Partial -> batch: ``(N, F)`` terms here, this rank's rows of their sum over ranks out."""
    return _SumRows.apply(y, list(shares), rank, group)


def rows_of_columns(h: torch.Tensor, shares: Sequence[int], cols: Sequence[int], rank: int,
                    group=None) -> torch.Tensor:
    """Columns -> batch: ``(N, cols[rank])`` here, ``(shares[rank], sum(cols))`` out, the
    feature blocks in rank order."""
    return _RowsOfColumns.apply(h, list(shares), list(cols), rank, group)


@torch.no_grad()
def gather_along(t: torch.Tensor, dim: int, sizes: Sequence[int], group=None) -> torch.Tensor:
    """The whole tensor whose block ``r`` along ``dim`` (``sizes[r]`` long) is ``t`` on rank
    ``r``, on every rank, detached (for checkpoints; no traffic recorded)."""
    return _all_gather(t.detach().movedim(dim, 0), sizes, group, None).movedim(0, dim).contiguous()
