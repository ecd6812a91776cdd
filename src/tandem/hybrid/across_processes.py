"""``DistributedHybrid``: the "one weird trick" with one process per device, on one or many machines.

The trunk (:mod:`.trunk`) runs under DDP, its gradients summed over ranks; the head's Linear
layers are split as :class:`~tandem.hybrid.HybridParallel` splits them, a block of features a
rank, the activations moving between stages (:mod:`.rank_collectives`) on a group of their own,
so DDP's all-reduce never interleaves with them. Not torch's tensor parallel: that shards a
batch as ``torch.chunk`` does, and its DTensors fit neither plain checkpoints nor DDP.

Each rank backpropagates its rows' share of the global mean, so a split block's gradient is
complete on its owner. :meth:`plain_state_dict` and :meth:`plain_optimizer_state` are
collectives; a rank lost is its blocks lost (resume from a checkpoint).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from tandem.keyed import stream as keyed_stream
from tandem.plain_norms import PlainNorms

from ..parallel import traffic
from ..parallel.shares import shares
from .plain import (block, check_plain_keys, in_order, load_part, load_plain_optimizer_state,
                    plain_optimizer_state)
from .rank_collectives import all_shares, gather_along, gather_rows, rows_of_columns, sum_rows
from .trunk import walk_head

#: traffic kind of the data-parallel gradients' all-reduce (see :func:`summing_hook`)
GRADIENTS = "gradients"


def block_sizes(features: int, world: int) -> list[int]:
    """Each rank's block of ``features``, as the one-process hybrid splits them (10 over 3 is
    4+3+3); ranks past the features get 0 (2 over 3: 1+1+0)."""
    return shares(features, [1] * world)


def summing_hook(group, bucket):  # DDP checks an annotation; a string one fails
    """A DDP comm hook that sums a gradient bucket over ranks (torch's default averages),
    recording the ``2 (W-1)/W`` of the bucket a ring all-reduce sends as ``gradients``."""
    buffer = bucket.buffer()
    world = dist.get_world_size(group)
    traffic.record(GRADIENTS, 2 * (world - 1) / world * buffer.numel() * buffer.element_size())
    work = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


class _Column(nn.Module):
    """This rank's block of a Linear's output features: ``(N, in) -> (N, sizes[rank])``."""

    def __init__(self, linear: nn.Linear, rank: int, world: int):
        super().__init__()
        self.sizes = block_sizes(linear.out_features, world)
        a, b = sum(self.sizes[:rank]), sum(self.sizes[:rank + 1])
        self.weight = nn.Parameter(linear.weight.detach()[a:b].clone())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach()[a:b].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def pieces(self) -> dict:
        """``{name: (parameter, dim its blocks are cut along, every rank's block size)}``."""
        return {k: (p, 0, self.sizes) for k, p in self.named_parameters()}


class _Row(nn.Module):
    """This rank's block of a Linear's input features: ``(N, sizes[rank]) -> (N, out)``, a
    term of the sum over ranks. Rank 0 holds the bias, the others an empty one in their graph,
    so every rank's optimizer keeps a state for it at the same steps."""

    def __init__(self, linear: nn.Linear, rank: int, world: int):
        super().__init__()
        self.sizes = block_sizes(linear.in_features, world)
        a, b = sum(self.sizes[:rank]), sum(self.sizes[:rank + 1])
        self.weight = nn.Parameter(linear.weight.detach()[:, a:b].clone())
        self.bias_sizes = [linear.out_features] + [0] * (world - 1)
        self.bias = None if linear.bias is None else nn.Parameter(
            linear.bias.detach()[: self.bias_sizes[rank]].clone())

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        partial = F.linear(h, self.weight)  # (N, out)
        if self.bias is None:
            return partial
        return partial + (self.bias if self.bias.numel() else self.bias.sum())

    def pieces(self) -> dict:
        out = {"weight": (self.weight, 1, self.sizes)}
        if self.bias is not None:
            out["bias"] = (self.bias, 0, self.bias_sizes)
        return out


class _Replicated(nn.Module):
    """What every rank holds whole (the trunk, the head's local layers), under one DDP."""

    def __init__(self, trunk: nn.Module, local: list[nn.Module]):
        super().__init__()
        self.trunk = trunk
        self.local = nn.ModuleList(local)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.trunk(x)  # (b_r, A)


class DistributedHybrid(nn.Module):
    """``model`` (on this rank's ``device``, the same weights on every rank) with a
    data-parallel trunk and its head split over the ranks of ``group``, which carries the
    activations. ``ddp_options``: ``DistributedDataParallel``'s keywords for the trunk (its
    ``process_group`` carries the gradients; default ``group``); ``head`` as in :mod:`.layout`;
    ``compressor``: the trunk's gradients' hook, compressing them (a summing
    :class:`~tandem.distributed.compression.Compressor`; default: exact, :func:`summing_hook`).
    Returns this rank's rows of the logits, ``(b_r, classes)``; :meth:`no_sync` is DDP's.
    """

    #: DDP's comm hook for the data-parallel gradients: they must be summed, not averaged
    grad_hook = staticmethod(summing_hook)
    #: the move of a rank's rows to every rank, whose backward returns their gradients summed
    gather = staticmethod(gather_rows)

    def __init__(self, model: nn.Module, device: torch.device, group=None,
                 head: str | None = None, ddp_options: dict | None = None,
                 compressor=None):
        super().__init__()
        mods, stages, key, trunk = walk_head(self, model, head, "DistributedHybrid")
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.device = torch.device(device)
        local, self._split, self._steps = [], [], []
        for stage in stages:
            first, last = stage.indices[0], stage.indices[-1]
            if stage.kind == "local":
                local.append(mods[first])
                self._parts.append((key(first), mods[first]))
                self._steps.append(("local", mods[first]))
                continue
            column = _Column(mods[first], self.rank, self.world)
            self._split.append((key(first), column))
            if stage.kind == "column":
                self._steps.append(("column", column))
                continue
            between = nn.Sequential(*[mods[i] for i in stage.indices[1:-1]])
            self._parts += [(key(i), mods[i]) for i in stage.indices[1:-1]]
            row = _Row(mods[last], self.rank, self.world)
            self._split.append((key(last), row))
            self._steps.append(("pair", column, between, row))
        self.head = nn.ModuleList(m for _, m in self._split)
        self.between = nn.ModuleList(s[2] for s in self._steps if s[0] == "pair")
        options = {"device_ids": [self.device] if self.device.type == "cuda" else None,
                   "process_group": group, **(ddp_options or {})}
        self.dp = DistributedDataParallel(_Replicated(trunk, local), **options)
        if compressor is not None:  # it must sum, as grad_hook does
            compressor.register(self.dp)
        else:
            self.dp.register_comm_hook(options["process_group"], self.grad_hook)
        self.shares: list[int] = []  # every rank's rows in the last forward

    def no_sync(self):
        """Gradients accumulate on each rank, not summed, until a forward outside it."""
        return self.dp.no_sync()

    def forward(self, x: torch.Tensor, shares: list[int] | None = None) -> torch.Tensor:
        """This rank's rows of the logits. ``shares``: every rank's rows of the global batch,
        as the loader cut it (``None``: asked of the other ranks, read on the host)."""
        h = self.dp(x)  # (b_r, A): this rank's rows
        if shares is None:
            shares = all_shares(h.shape[0], h.device, self.group)
        elif shares[self.rank] != h.shape[0]:
            raise ValueError(f"rank {self.rank} has {h.shape[0]} rows but its share of the "
                             f"batch is {shares[self.rank]} ({shares})")
        self.shares = list(shares)
        rank, group = self.rank, self.group
        for step in self._steps:
            if step[0] == "local":
                h = step[1](h)  # (b_r, F), on this rank's rows
                continue
            column = step[1]
            block_ = column(self.gather(h, shares, rank, group))  # (N, cols[rank])
            if step[0] == "column":
                h = rows_of_columns(block_, shares, column.sizes, rank, group)  # (b_r, out)
                continue
            _, _, between, row = step
            work = torch.promote_types(block_.dtype, torch.float32)  # as one matmul would sum
            # every rank's rows, this rank's columns: keyed dropout draws that block of the mask
            with keyed_stream.at(0, sum(column.sizes[:rank])):
                block_ = between(block_)
            partial = row(block_).to(work)  # (N, out): this rank's term
            h = sum_rows(partial, shares, rank, group).to(block_.dtype)  # (b_r, out)
        return h

    # -- the plain model's view (gathering is a collective: every rank calls it) -----------
    def pieces(self) -> list[tuple[str, torch.Tensor, int | None, list[int] | None]]:
        """Each plain parameter as ``(name, this rank's tensor, dim, every rank's sizes)``, in
        the plain model's order; ``dim`` ``None``: held whole by every rank."""
        where = {}
        for prefix, module in self._parts:
            for k, param in module.named_parameters():
                where.setdefault(prefix + k, (prefix + k, param, None, None))
        for prefix, module in self._split:
            for k, (param, dim, sizes) in module.pieces().items():
                where[prefix + k] = (prefix + k, param, dim, sizes)
        return [where[n] for n in self._param_names]

    def plain_norms(self, reduce) -> PlainNorms:
        """Norms of the plain model's parameters: a split layer's blocks summed over the ranks
        by ``reduce`` (a collective), what every rank holds whole counted once."""
        pieces = self.pieces()
        return PlainNorms([p for _, p, _, _ in pieces],
                          spread=[k for k, (_, _, dim, _) in enumerate(pieces) if dim is not None],
                          reduce=reduce, device=self.device)

    def _whole(self, shapes_only: bool) -> dict:
        """The plain state dict: split layers gathered, or (``shapes_only``) meta tensors of
        their whole shapes (no collective); replicated tensors as this rank holds them."""
        state = {prefix + k: v for prefix, module in self._parts
                 for k, v in module.state_dict().items()}
        for prefix, module in self._split:
            for k, (param, dim, sizes) in module.pieces().items():
                if shapes_only:
                    shape = list(param.shape)
                    shape[dim] = sum(sizes)
                    state[prefix + k] = torch.empty(shape, dtype=param.dtype, device="meta")
                else:
                    state[prefix + k] = gather_along(param, dim, sizes, self.group)
        return in_order(state, self._keys, "DistributedHybrid")

    def plain_state_dict(self) -> "OrderedDict[str, torch.Tensor]":
        """The plain model's state dict on every rank (a collective)."""
        return self._whole(shapes_only=False)

    def plain_shapes(self) -> dict:
        """The plain state dict's keys, each with a meta tensor of its shape (no collective)."""
        return dict(self._whole(shapes_only=True))

    def load_plain_state_dict(self, state: dict, strict: bool = True) -> None:
        """Load a plain model's state dict (any strategy's), split layers taking this rank's
        blocks; no collective. A key missing or extra (when ``strict``) is an error."""
        if strict:
            check_plain_keys(self._keys, state, "the model")
        with torch.no_grad():
            for prefix, module in self._parts:
                load_part(module, state, prefix, self.head_name, strict)
            for prefix, module in self._split:
                for k, (param, dim, sizes) in module.pieces().items():
                    if prefix + k in state:
                        param.copy_(block(state[prefix + k], dim, sizes, self.rank))

    def plain_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """``optimizer``'s state as the plain model's optimizer holds it, on every rank (a
        collective)."""
        pieces = self.pieces()
        plain = plain_optimizer_state(optimizer, [(n, [p], None) for n, p, _, _ in pieces])
        for k, (_, _, dim, sizes) in enumerate(pieces):
            held = plain["state"].get(k)
            if dim is not None and held is not None:
                plain["state"][k] = {key: gather_along(v, dim, sizes, self.group)
                                     if torch.is_tensor(v) and v.dim() > 0 else v
                                     for key, v in held.items()}
        return plain

    def load_plain_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Load a plain model's optimizer state (any strategy's), split parameters taking this
        rank's blocks of their states; no collective."""
        pieces = self.pieces()
        counted = sum(len(group["params"]) for group in state["param_groups"])
        if counted != len(pieces):
            raise ValueError(f"it holds {counted} parameters' state, the model has "
                             f"{len(pieces)}")
        mine = dict(state, state=dict(state["state"]))
        for k, (name, _, dim, sizes) in enumerate(pieces):
            held = state["state"].get(k)
            if dim is not None and held is not None:
                mine["state"][k] = {key: block(v, dim, sizes, self.rank, f"{name}'s {key}")
                                    if torch.is_tensor(v) and v.dim() > 0 else v
                                    for key, v in held.items()}
        load_plain_optimizer_state(optimizer, [(n, [p], None) for n, p, _, _ in pieces], mine)
