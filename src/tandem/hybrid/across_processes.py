"""``DistributedHybrid``: the "one weird trick" with one process per device, on one or many machines.

The trunk (everything before the Linear head, :mod:`.trunk`) is data parallel: each rank runs it
on its own rows, and torch's ``DistributedDataParallel`` sums the ranks' gradients. The head's
Linear layers are split as :class:`~tandem.hybrid.HybridParallel` splits them
(:mod:`.layout`): a column layer's output features and a row layer's input features are cut
into one block per rank, and each rank keeps only its block. Between stages the activations
move (:mod:`.rank_collectives`): the trunk's rows are gathered for a column layer, a row layer's
partial sums come back to each rank as its own rows, and a gathered column layer's blocks are
exchanged so that each rank ends with the logits of its own rows. Other head layers run on a
rank's own rows, data parallel.

Why not torch's own pieces. ``torch.distributed.tensor.parallel``'s ``ColwiseParallel`` and
``RowwiseParallel`` shard a batch as ``torch.chunk`` does (the last ranks short or empty, 5 rows
over 4 ranks is 2+2+1+0), where tandem's loader gives 2+1+1+1; its parameters are DTensors,
which tandem's plain checkpoints, optimizer layout and one-process strategies do not read; and
DDP would then have to skip them, which only a private DDP call (``_set_params_and_buffers_to_
ignore_for_model``) does. So DDP wraps only what is data parallel (a public use), with a comm
hook that sums instead of averaging, and the head's moves are autograd Functions over
``all_gather_into_tensor``, ``reduce_scatter_single`` and ``all_to_all_single``, which gloo and
NCCL both run (gloo does not gather uneven pieces, hence the padding). The activations travel on
a group of their own, so DDP's asynchronous gradient all-reduce never interleaves with them.

The update is the single device's: the loss each rank backpropagates is its rows' share of the
global mean (``world_size=1`` in :func:`tandem.distributed.global_loss.global_mean`), so a
split block's gradient, computed on the whole batch, is complete on its owner, and the
data-parallel gradients are the sum over ranks. Warnings: each rank holds only its blocks, so
:meth:`plain_state_dict` and :meth:`plain_optimizer_state` are collectives that every rank must
call; a rank lost is its blocks lost (resume from the last checkpoint). Keyed dropout between
split layers draws this rank's columns of the whole batch's mask (:mod:`tandem.keyed`).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from tandem.errors import UsageError
from tandem.keyed import stream as keyed_stream
from tandem.plain_norms import PlainNorms

from ..parallel import traffic
from ..parallel.guards import first_lazy
from ..parallel.shares import shares
from ._shards import check_plain_keys
from .layout import classifier_layout, find_head, head_sequential
from .optimizer_state import load_plain_optimizer_state, plain_optimizer_state
from .rank_collectives import all_shares, gather_along, gather_rows, rows_of_columns, sum_rows
from .trunk import trunk_of

__all__ = ["DistributedHybrid", "block_sizes", "summing_hook", "GRADIENTS"]


#: traffic kind of the data-parallel gradients' all-reduce (see :func:`summing_hook`)
GRADIENTS = "gradients"


def block_sizes(features: int, world: int) -> list[int]:
    """Each rank's block of ``features`` split features, one entry per rank: as the one-process
    hybrid splits them (10 over 3 is 4+3+3); ranks past the features get 0 (2 over 3: 1+1+0)."""
    return shares(features, [1] * world)


def summing_hook(group, bucket):  # DDP checks an annotation; a string one fails
    """A DDP comm hook that sums a gradient bucket over ranks (torch's default averages). It
    records the bytes a ring all-reduce sends from each rank, ``2 (W-1)/W`` of the bucket, as
    ``gradients`` in :mod:`tandem.parallel.traffic`."""
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
        a = sum(self.sizes[:rank])
        b = a + self.sizes[rank]
        self.weight = nn.Parameter(linear.weight.detach()[a:b].clone())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach()[a:b].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def pieces(self) -> dict:
        """``{name: (parameter, dim its blocks are cut along, every rank's block size)}``."""
        out = {"weight": (self.weight, 0, self.sizes)}
        if self.bias is not None:
            out["bias"] = (self.bias, 0, self.sizes)
        return out


class _Row(nn.Module):
    """This rank's block of a Linear's input features: ``(N, sizes[rank]) -> (N, out)``, one
    term of the sum over ranks. The bias is rank 0's (added once); other ranks hold an empty
    one, so that every parameter is one rank's block and checkpoints merge them alike; it
    still enters their graph (adding its empty sum, 0), so that every rank's optimizer keeps
    a state for it at the same steps (gathering that state is a collective)."""

    def __init__(self, linear: nn.Linear, rank: int, world: int):
        super().__init__()
        self.sizes = block_sizes(linear.in_features, world)
        a = sum(self.sizes[:rank])
        b = a + self.sizes[rank]
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
    """What every rank holds whole: the trunk (its forward) and the head's local layers (run
    by the head, between collectives). One DDP wraps both, so one set of buckets sums their
    gradients; a local layer's gradient is ready when the head's backward passes it."""

    def __init__(self, trunk: nn.Module, local: list[nn.Module]):
        super().__init__()
        self.trunk = trunk
        self.local = nn.ModuleList(local)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.trunk(x)  # (b_r, A)


class DistributedHybrid(nn.Module):
    """``model`` (already on this rank's ``device``, the same weights on every rank) with a
    data-parallel trunk and its head split over the ranks of ``group``.

    ``group`` carries the activations. ``ddp_options`` are ``DistributedDataParallel``'s
    keywords for the data-parallel part (its ``process_group`` carries the gradients; default
    ``group``). ``head`` names the classifier (see :mod:`.layout`). The logits it returns are
    this rank's rows', ``(b_r, classes)``; :meth:`no_sync` is DDP's.
    """

    #: DDP's comm hook for the data-parallel gradients: they must be summed, not averaged
    grad_hook = staticmethod(summing_hook)
    #: the move of a rank's rows to every rank, whose backward returns their gradients summed
    gather = staticmethod(gather_rows)

    def __init__(self, model: nn.Module, device: torch.device, group=None,
                 head: str | None = None, ddp_options: dict | None = None):
        super().__init__()
        name = find_head(model, head, who="DistributedHybrid")
        lazy = first_lazy(model)
        if lazy is not None:
            raise UsageError(f"DistributedHybrid needs an initialised model: {lazy!r} of "
                             f"{type(model).__name__} is lazy; run the model once on a batch "
                             f"before wrapping it")
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.device = torch.device(device)
        head_module = getattr(model, name)
        mods = list(head_sequential(head_module))
        leading, stages = classifier_layout(head_sequential(head_module))
        indexed = isinstance(head_module, nn.Sequential)

        def key(i: int) -> str:  # where layer i of the head keeps its state in the plain model
            return f"{name}.{i}." if indexed else f"{name}."

        # (prefix in the plain state dict, module holding that state): whole on every rank
        trunk, self._parts = trunk_of(model, name, [mods[i] for i in leading])
        self._parts += [(key(i), mods[i]) for i in leading]
        self.head_name = name
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
        self.dp.register_comm_hook(options["process_group"], self.grad_hook)
        self._keys = list(model.state_dict().keys())
        self._param_names = [n for n, _ in model.named_parameters()]
        self.shares: list[int] = []  # every rank's rows in the last forward

    def no_sync(self):
        """Gradients accumulate on each rank, not summed, until a forward outside it."""
        return self.dp.no_sync()

    def forward(self, x: torch.Tensor, shares: list[int] | None = None) -> torch.Tensor:
        """This rank's rows of the logits. ``shares``: every rank's rows of the global batch,
        as the loader cut it (``None``: asked of the other ranks, one all-gather read on the
        host)."""
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
            block = column(self.gather(h, shares, rank, group))  # (N, cols[rank])
            if step[0] == "column":
                h = rows_of_columns(block, shares, column.sizes, rank, group)  # (b_r, out)
                continue
            _, _, between, row = step
            work = torch.promote_types(block.dtype, torch.float32)  # as one matmul would sum
            # every rank's rows, this rank's columns: keyed dropout draws that block of the mask
            with keyed_stream.at(0, sum(column.sizes[:rank])):
                block = between(block)
            partial = row(block).to(work)  # (N, out): this rank's term
            h = sum_rows(partial, shares, rank, group).to(block.dtype)  # (b_r, out)
        return h

    # -- the plain model's view (collectives: every rank calls them) ------------------------
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
        """Norms of the plain model's parameters (:mod:`tandem.plain_norms`): a split layer's
        blocks summed over the ranks by ``reduce`` (a collective every rank joins); what every
        rank holds whole counted once."""
        pieces = self.pieces()
        return PlainNorms([p for _, p, _, _ in pieces],
                          spread=[k for k, (_, _, dim, _) in enumerate(pieces) if dim is not None],
                          reduce=reduce, device=self.device)

    def plain_state_dict(self) -> "OrderedDict[str, torch.Tensor]":
        """The plain model's state dict on every rank (split layers gathered): the same keys and
        order as ``model.state_dict()``; replicated modules' tensors as this rank holds them."""
        state = {}
        for prefix, module in self._parts:
            for k, value in module.state_dict().items():
                state[prefix + k] = value
        for prefix, module in self._split:
            for k, (param, dim, sizes) in module.pieces().items():
                state[prefix + k] = gather_along(param, dim, sizes, self.group)
        if set(state) != set(self._keys):  # a bug here, never a user error
            raise RuntimeError(f"DistributedHybrid lost track of keys: "
                               f"{sorted(set(state) ^ set(self._keys))[:3]}")
        return OrderedDict((k, state[k]) for k in self._keys)

    def load_plain_state_dict(self, state: dict, strict: bool = True) -> None:
        """Load a plain model's state dict (any strategy's): split layers take this rank's
        blocks. Local: no collective. A key missing or extra (when ``strict``) is an error."""
        if strict:
            check_plain_keys(self._keys, state, "the model")
        with torch.no_grad():
            for prefix, module in self._parts:
                if prefix:
                    sub = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
                else:  # the body: every key but the head's
                    sub = {k: v for k, v in state.items()
                           if not k.startswith(self.head_name + ".")}
                try:
                    module.load_state_dict(sub, strict=strict)
                except RuntimeError as exc:
                    first = str(exc).strip().splitlines()
                    raise UsageError(f"cannot load {prefix}*: {first[-1].strip()}") from None
            for prefix, module in self._split:
                for k, (param, dim, sizes) in module.pieces().items():
                    if prefix + k in state:
                        param.copy_(_block(state[prefix + k], dim, sizes, self.rank))

    def plain_shapes(self) -> dict:
        """The plain state dict's keys, each with a meta tensor of its shape (no collective):
        what a state must fit before :meth:`load_plain_state_dict`."""
        shapes = {}
        for prefix, module in self._parts:
            for k, value in module.state_dict().items():
                shapes[prefix + k] = value
        for prefix, module in self._split:
            for k, (param, dim, sizes) in module.pieces().items():
                shape = list(param.shape)
                shape[dim] = sum(sizes)
                shapes[prefix + k] = torch.empty(shape, dtype=param.dtype, device="meta")
        return {k: shapes[k] for k in self._keys}

    def plain_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """``optimizer``'s state as an optimizer of the plain model holds it, on every rank:
        split parameters' states gathered (see :mod:`.optimizer_state`)."""
        pieces = self.pieces()
        plain = plain_optimizer_state(optimizer, [(n, [p], None) for n, p, _, _ in pieces])
        for k, (_, _, dim, sizes) in enumerate(pieces):
            held = plain["state"].get(k)
            if dim is None or held is None:
                continue
            plain["state"][k] = {key: gather_along(v, dim, sizes, self.group)
                                 if torch.is_tensor(v) and v.dim() > 0 else v
                                 for key, v in held.items()}
        return plain

    def load_plain_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Load a plain model's optimizer state (any strategy's): split parameters take this
        rank's blocks of their states. Local: no collective."""
        pieces = self.pieces()
        counted = sum(len(group["params"]) for group in state["param_groups"])
        if counted != len(pieces):
            raise ValueError(f"it holds {counted} parameters' state, the model has "
                             f"{len(pieces)}")
        mine = dict(state, state=dict(state["state"]))
        for k, (name, _, dim, sizes) in enumerate(pieces):
            held = state["state"].get(k)
            if dim is None or held is None:
                continue
            mine["state"][k] = {key: _block(v, dim, sizes, self.rank, f"{name}'s {key}")
                                if torch.is_tensor(v) and v.dim() > 0 else v
                                for key, v in held.items()}
        load_plain_optimizer_state(optimizer, [(n, [p], None) for n, p, _, _ in pieces], mine)


def _block(value: torch.Tensor, dim: int, sizes: list[int], rank: int,
           what: str = "") -> torch.Tensor:
    """Rank ``rank``'s block of a whole tensor cut along ``dim`` into ``sizes``."""
    if value.shape[dim] != sum(sizes):
        raise ValueError(f"{what or 'a split tensor'} has shape {tuple(value.shape)}, "
                         f"{sum(sizes)} along dimension {dim} expected")
    return value.split(sizes, dim)[rank].clone()
