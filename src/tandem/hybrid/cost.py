"""The bytes a strategy moves in one training step, counted from the model's layers (nothing runs).

One process, :func:`plan`: the bytes crossing between devices, data parallel versus hybrid, and
the split's sample-times (:func:`~tandem.parallel.split.split_report`). Several processes,
:func:`step_bytes`: the bytes each rank sends, ddp versus hybrid-ddp, as bandwidth-optimal
collectives send them (what :mod:`tandem.parallel.traffic` records; a wire adds framing).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn

from tandem.distributed.compression import NONE, Compression
from tandem.errors import UsageError

from ..models import mac_breakdown
from ..parallel.devices import resolve_devices
from ..parallel.split import check_weights, shares, split_report
from ._shards import split_sizes
from .layout import classifier_layout, find_head, head_sequential
from .rank_collectives import reduce_scatter_factor

_KINDS = ("gradients", "buffers", "activations", "activation_grads")  # step_bytes' rows


def meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are on the meta device (no memory)."""
    memo: dict = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def _count(tensors) -> int:
    return sum(t.numel() for t in tensors if t.is_floating_point())


def _head(model: nn.Module, head: str | None, who: str):
    """``(name, head module, its layers, leading indices, stages, bytes per element)``."""
    name = find_head(model, head, who=who)
    module = getattr(model, name)
    leading, stages = classifier_layout(head_sequential(module))
    first = next(model.parameters(), None)
    e = first.element_size() if first is not None else 4
    return name, module, list(head_sequential(module)), leading, stages, e


# -- one process: what crosses between its devices -------------------------------------------
@dataclass
class HybridPlan:
    """Parameters, MACs and cross-device bytes of one step, data parallel versus hybrid."""

    model: str
    batch_size: int
    num_devices: int
    input_size: tuple
    bytes_per_element: int
    params_trunk: int
    params_classifier: int
    macs_trunk: int  # forward, whole batch
    macs_classifier: int
    layout: list[str] = field(default_factory=list)
    dp_bytes: dict[str, int] = field(default_factory=dict)
    hybrid_bytes: dict[str, int] = field(default_factory=dict)
    break_even_batch: int | None = None  # largest batch at which hybrid still moves less
    split: list[str] = field(default_factory=list)  # the trunk's shares: bytes, expected time

    @property
    def dp_total(self) -> int:
        return sum(v for k, v in self.dp_bytes.items() if k != "inputs")

    @property
    def hybrid_total(self) -> int:
        return sum(v for k, v in self.hybrid_bytes.items() if k != "inputs")

    @property
    def ratio(self) -> float:
        """DP bytes / hybrid bytes (inputs excluded); ``> 1`` means hybrid moves less."""
        return self.dp_total / self.hybrid_total if self.hybrid_total else float("inf")

    @property
    def verdict(self) -> str:
        if self.dp_total == 0 and self.hybrid_total == 0:
            return "one device: nothing moves either way"
        if self.dp_total and self.hybrid_total and round(max(self.ratio, 1 / self.ratio), 1) < 1.1:
            fewer, more = sorted((self.dp_total, self.hybrid_total))
            share = f"{100 * (more - fewer) / more:.1f}% fewer"
            if self.hybrid_total < self.dp_total:
                return f"hybrid and data parallel move about the same bytes (hybrid {share})"
            return f"hybrid and data parallel move about the same bytes (data parallel {share})"
        if self.hybrid_total < self.dp_total:
            text = f"hybrid moves {self.ratio:.1f}x fewer bytes than data parallel"
            if self.break_even_batch is not None:
                text += f" (and keeps moving fewer up to a batch of {self.break_even_batch:,})"
            return text
        return (f"data parallel is cheaper here: it moves {1 / self.ratio:.1f}x fewer bytes"
                if self.dp_total else "data parallel is cheaper here")

    def report(self) -> str:
        """The plan as a text table."""
        p_all = self.params_trunk + self.params_classifier or 1
        m_all = self.macs_trunk + self.macs_classifier or 1
        mb, n = 1e6, max(self.num_devices, 1)
        lines = [
            f"hybrid plan: {self.model}, batch {self.batch_size} over {self.num_devices} "
            f"device(s), input {'x'.join(map(str, self.input_size))}, "
            f"{self.bytes_per_element} bytes/element",
            f"{'':<22}{'parameters':>14}{'share':>8}{'MACs/step':>18}{'share':>8}",
        ]
        for name, p, m in (("trunk (data parallel)", self.params_trunk, self.macs_trunk),
                           ("classifier (split)", self.params_classifier, self.macs_classifier)):
            lines.append(f"{name:<22}{p:>14,}{p / p_all:>8.1%}{m:>18,}{m / m_all:>8.1%}")
        lines += ["classifier layout:"] + [f"  {row}" for row in self.layout]
        lines.append(f"{'MB per step':<22}{'data parallel':>16}{'split':>12}")
        rows = [(k, self.dp_bytes.get(k, 0), self.hybrid_bytes.get(k, 0))
                for k in ("inputs", "parameters", "buffers", "gradients", "activations")]
        rows += [("total (no inputs)", self.dp_total, self.hybrid_total),
                 ("per device", self.dp_total / n, self.hybrid_total / n)]
        lines += [f"  {k:<20}{d / mb:>16.2f}{h / mb:>12.2f}" for k, d, h in rows]
        lines += self.split
        lines.append(f"verdict: {self.verdict}")
        return "\n".join(lines)

    __str__ = report


def _device_bytes(*, batch, n, s, x, out_classes, p_all, f_all, p_trunk, f_trunk, act, stages,
                  mods, weights=None):
    """(dp, hybrid) byte dicts of one step of ``batch`` over ``n`` devices: replicas 1..m-1
    receive parameters and buffers and send gradients (hybrid: the trunk's); activations count
    each value and its gradient (``s`` bytes per element, ``x`` input elements per sample)."""
    chunks = shares(batch, weights or (1.0,) * n)  # one per device, some maybe 0
    m, rest = 1 + sum(1 for c in chunks[1:] if c), batch - chunks[0]
    dp = {"inputs": rest * x * s, "parameters": (m - 1) * p_all * s,
          "buffers": (m - 1) * f_all * s, "gradients": (m - 1) * p_all * s,
          "activations": 2 * rest * out_classes * s}
    moved = 0
    for i, stage in enumerate(stages):
        if stage.kind == "local":
            moved += rest * act if i == 0 else 0
            continue
        lin = mods[stage.indices[0]]
        sizes = split_sizes(lin.out_features, n)
        if i == 0:  # every shard gathers the chunks of the other replicas
            moved += sum(batch - chunks[j] for j in range(len(sizes))) * lin.in_features
        else:  # the other shards fetch the whole input from the output device
            moved += (len(sizes) - 1) * batch * lin.in_features
        if stage.kind == "column":  # the other shards' blocks, gathered
            moved += batch * (lin.out_features - sizes[0])
        else:  # the other shards' partial sums
            moved += (len(sizes) - 1) * batch * mods[stage.indices[-1]].out_features
    hybrid = dict(dp, parameters=(m - 1) * p_trunk * s, buffers=(m - 1) * f_trunk * s,
                  gradients=(m - 1) * p_trunk * s, activations=2 * moved * s)
    return dp, hybrid


def _layout_rows(head: nn.Module, name: str, mods, leading, stages, n: int) -> list[str]:
    def at(i: int) -> str:  # the layer's name in the model
        return f"{name}.{i}" if isinstance(head, nn.Sequential) else name

    rows = [f"{at(i)} {type(mods[i]).__name__}: per batch chunk, data parallel" for i in leading]
    for stage in stages:
        i = stage.indices[0]
        if stage.kind == "local":
            rows.append(f"{at(i)} {type(mods[i]).__name__}: whole batch on device 0")
            continue
        lin = mods[i]
        sizes = split_sizes(lin.out_features, n)
        rows.append(f"{at(i)} Linear {lin.in_features}->{lin.out_features}: column over "
                    f"{sizes}{', gathered' if stage.kind == 'column' else ', kept split'}")
        if stage.kind == "pair":
            rows += [f"{at(j)} {type(mods[j]).__name__}: per shard" for j in stage.indices[1:-1]]
            row = mods[stage.indices[-1]]
            rows.append(f"{at(stage.indices[-1])} Linear {row.in_features}->"
                        f"{row.out_features}: row over {sizes}, partial sums to device 0")
    return rows


def _break_even(batch_size: int, common: dict) -> int | None:
    """The largest batch at which hybrid still moves fewer bytes than data parallel (inputs
    aside), when it does at ``batch_size``; else None."""
    def hybrid_cheaper(b: int) -> bool:
        d, h = _device_bytes(batch=b, **common)
        return sum(h.values()) - h["inputs"] < sum(d.values()) - d["inputs"]

    if not (common["n"] > 1 and hybrid_cheaper(batch_size)):
        return None
    lo, hi = batch_size, batch_size * 2
    while hybrid_cheaper(hi) and hi < 1 << 24:
        lo, hi = hi, hi * 2
    if hybrid_cheaper(hi):
        return None
    while hi - lo > 1:  # lo cheaper, hi not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if hybrid_cheaper(mid) else (lo, mid)
    return lo


def plan(model: nn.Module, device_ids=None, batch_size: int = 128,
         input_size=(3, 224, 224), head: str | None = None, split=None, per_sample=None,
         unit: str | None = None) -> HybridPlan:
    """Cost of one step of ``model`` in one process, hybrid versus data parallel (a meta copy
    is traced; ``model`` is not run or modified).

    ``device_ids``: a device list or a count (devices this machine need not have);
    ``input_size``: one sample's ``(C, H, W)`` or a side; ``head`` as for
    :class:`HybridParallel`; ``split``: the trunk's batch weights (default even);
    ``per_sample``: each device's seconds per sample, for the split's expected step time.
    """
    name, classifier, mods, leading, stages, s = _head(model, head, "plan")
    if isinstance(device_ids, int) and not isinstance(device_ids, bool):
        if device_ids < 1:
            raise UsageError(f"plan needs at least 1 device, got {device_ids}")
        n = device_ids
    else:
        n = len(resolve_devices(device_ids))
    if batch_size < 1:
        raise UsageError(f"batch_size must be >= 1, got {batch_size}")
    shape = (3, input_size, input_size) if isinstance(input_size, int) else tuple(
        int(v) for v in input_size)
    if not shape or any(v < 1 for v in shape):
        raise UsageError(f"input_size must be a side or a (C, H, W) shape, got {input_size!r}")
    weights = None if split is None else check_weights(split, n)
    meta, seen = meta_copy(model), {}  # one trace: MACs, the head's input and output sizes
    getattr(meta, name).register_forward_hook(  # the copy is dropped after: so is the hook
        lambda mod, args, out: seen.update(act=args[0][0].numel(), out=out[0].numel()))
    macs = mac_breakdown(meta, (1,) + shape)
    mac_cls = sum(v for k, v in macs.items() if k == name or k.startswith(name + "."))
    mac_trunk = sum(macs.values()) - mac_cls
    p_all, p_cls = _count(model.parameters()), _count(classifier.parameters())
    f_all, f_cls = _count(model.buffers()), _count(classifier.buffers())
    x = int(torch.Size(shape).numel())
    common = dict(n=n, s=s, x=x, out_classes=seen["out"], p_all=p_all, f_all=f_all,
                  p_trunk=p_all - p_cls, f_trunk=f_all - f_cls, act=seen["act"],
                  stages=stages, mods=mods, weights=weights)
    dp, hybrid = _device_bytes(batch=batch_size, **common)
    return HybridPlan(
        model=type(model).__name__, batch_size=batch_size, num_devices=n, input_size=shape,
        bytes_per_element=s, params_trunk=p_all - p_cls, params_classifier=p_cls,
        macs_trunk=mac_trunk * batch_size, macs_classifier=mac_cls * batch_size,
        layout=_layout_rows(classifier, name, mods, leading, stages, n),
        dp_bytes=dp, hybrid_bytes=hybrid, break_even_batch=_break_even(batch_size, common),
        split=split_report(batch_size, n, weights, per_sample, x * s, unit))


# -- several processes: what each rank sends -------------------------------------------------
@dataclass
class ProcessBytes:
    """Bytes each rank sends in one step, ddp and hybrid-ddp: one dict a rank, by kind
    (gradients, buffers, activations, activation_grads)."""

    model: str
    batch_size: int
    processes: int
    ddp: list[dict]
    hybrid: list[dict]

    @staticmethod
    def busiest(rows: list[dict]) -> dict:
        """The busiest rank's row of ``rows`` (:attr:`ddp` or :attr:`hybrid`): what a link
        carrying every rank's traffic waits for."""
        return max(rows, key=lambda row: sum(row.values()))

    @classmethod
    def most(cls, rows: list[dict]) -> float:
        """The busiest rank's bytes."""
        return sum(cls.busiest(rows).values())

    def report(self) -> str:
        mb = 1e6
        lines = [f"bytes sent per step per process: {self.model}, batch {self.batch_size} over "
                 f"{self.processes} processes (busiest rank)",
                 f"{'MB':<22}{'data parallel':>14}{'split head':>12}"]
        for kind in _KINDS:
            d = max(row.get(kind, 0) for row in self.ddp)
            h = max(row.get(kind, 0) for row in self.hybrid)
            lines.append(f"  {kind:<20}{d / mb:>14.2f}{h / mb:>12.2f}")
        lines.append(f"  {'total':<20}{self.most(self.ddp) / mb:>14.2f}"
                     f"{self.most(self.hybrid) / mb:>12.2f}")
        return "\n".join(lines)

    __str__ = report


def _rank_head_bytes(stages, mods, shares_: list[int], rank: int, e: int,
                     backend: str) -> tuple[int, int]:
    """(forward, backward) bytes rank ``rank`` sends for the head's activations: a column
    layer's input all-gathered, ``(W-1) m in e`` (``m`` the largest share), its gradient
    reduce-scattered; a row layer's output reduce-scattered (float32 at least), its gradient
    all-gathered; a gathered column's blocks exchanged. gloo's reduce-scatter is an
    all-reduce: twice the bytes."""
    world, most, n, mine = len(shares_), max(shares_), sum(shares_), shares_[rank]
    scatter = reduce_scatter_factor(backend)
    fwd = bwd = 0
    for stage in stages:
        if stage.kind == "local":
            continue
        lin = mods[stage.indices[0]]
        gathered = (world - 1) * most * lin.in_features * e
        fwd, bwd = fwd + gathered, bwd + scatter * gathered
        if stage.kind == "column":
            cols = shares(lin.out_features, [1] * world)[rank]  # across_processes.block_sizes
            fwd += (n - mine) * cols * e
            bwd += mine * (lin.out_features - cols) * e
        else:
            summed = (world - 1) * most * mods[stage.indices[-1]].out_features * max(e, 4)
            fwd, bwd = fwd + scatter * summed, bwd + summed
    return fwd, bwd


def gradient_bytes(parameters, processes: int, compression: Compression = NONE) -> float:
    """Bytes each of ``processes`` ranks sends to all-reduce the gradients of ``parameters``
    in one step: a ring's ``2 (W-1)/W`` of what it hands over, ``P e`` exact, less compressed
    (:meth:`~tandem.distributed.compression.Compression.sent_bytes`)."""
    w = processes
    return 2 * (w - 1) / w * compression.sent_bytes(p for p in parameters if p.is_floating_point())


def step_bytes(model: nn.Module, batch_size: int, processes: int, head: str | None = None,
               backend: str = "nccl", compression: Compression = NONE) -> ProcessBytes:
    """What each of ``processes`` ranks sends in one step of ``batch_size`` global samples
    (even shares) over ``backend`` (``"nccl"`` or ``"gloo"``). ddp: every gradient, ``2 (W-1)/W
    P e`` (less under ``compression``); hybrid-ddp: the data-parallel gradients so, and the
    head's activations. Both: the buffers DDP broadcasts under ``--buffers replica0``. Not
    counted: the loss and the shares."""
    if processes < 1 or batch_size < 1:
        raise UsageError(f"step_bytes needs a batch and processes >= 1, got batch "
                         f"{batch_size} over {processes}")
    if backend not in ("nccl", "gloo"):
        raise UsageError(f"step_bytes: backend must be 'nccl' or 'gloo', got {backend!r}")
    _, _, mods, _, stages, e = _head(model, head, "step_bytes")
    split = [mods[i] for s in stages if s.kind != "local" for i in (s.indices[0], s.indices[-1])]
    held = {id(p) for m in split for p in m.parameters()}
    trunk = [p for p in model.parameters() if id(p) not in held]
    w, rows = processes, shares(batch_size, [1] * processes)
    buffers = (w - 1) / w * _count(model.buffers()) * e  # what DDP broadcasts
    every = gradient_bytes(model.parameters(), w, compression)
    ddp = [{"gradients": every, "buffers": buffers} for _ in range(w)]
    hybrid = []
    for rank in range(w):
        fwd, bwd = _rank_head_bytes(stages, mods, rows, rank, e, backend)
        hybrid.append({"gradients": gradient_bytes(trunk, w, compression),
                       "buffers": buffers,  # split layers hold none
                       "activations": fwd, "activation_grads": bwd})
    return ProcessBytes(type(model).__name__, batch_size, w, ddp, hybrid)
