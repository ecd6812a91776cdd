"""When does the "one weird trick" pay? A static cost report, built without running anything.

:func:`plan` counts parameters and forward MACs of trunk versus classifier (on a meta-device
copy) and the bytes one training step moves between devices, data parallel versus hybrid
(formulas in :func:`_bytes`). The DP total equals what a ring all-reduce (DDP) sends, so the
comparison holds for one process and for many. These are the bytes
:class:`~tandem.parallel.traffic.TrafficMeter` counts, except that scatter and gather record
only the forward direction.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn

from tandem.errors import UsageError

from ..models import mac_breakdown
from ..parallel.devices import resolve_devices
from ..parallel.split import check_weights, shares, split_report
from ._shards import split_sizes
from .layout import classifier_layout, find_head, head_sequential

__all__ = ["HybridPlan", "plan", "meta_copy"]


def meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are on the meta device (no memory)."""
    memo: dict = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


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
            # "1.0x fewer" says nothing: within 5% the two move about the same
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
        mb = 1e6
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
        for kind in ("inputs", "parameters", "buffers", "gradients", "activations"):
            lines.append(f"  {kind:<20}{self.dp_bytes.get(kind, 0) / mb:>16.2f}"
                         f"{self.hybrid_bytes.get(kind, 0) / mb:>12.2f}")
        n = max(self.num_devices, 1)
        lines.append(f"  {'total (no inputs)':<20}{self.dp_total / mb:>16.2f}"
                     f"{self.hybrid_total / mb:>12.2f}")
        lines.append(f"  {'per device':<20}{self.dp_total / n / mb:>16.2f}"
                     f"{self.hybrid_total / n / mb:>12.2f}")
        lines += self.split
        lines.append(f"verdict: {self.verdict}")
        return "\n".join(lines)

    __str__ = report


def _bytes(*, batch, n, s, x, out_classes, p_all, f_all, p_trunk, f_trunk, act, stages, mods,
           weights=None):
    """(dp, hybrid) byte dicts for one batch size.

    Replicas 1..m-1 receive parameters and buffers and send gradients (hybrid: the trunk's
    only); activations count each value and its gradient: DP gathers the logits, hybrid moves
    what each classifier stage needs (``s`` bytes per element, ``x`` input elements per sample).
    """
    chunks = shares(batch, weights or (1.0,) * n)  # one per device, some maybe 0
    m, rest = 1 + sum(1 for c in chunks[1:] if c), batch - chunks[0]
    dp = {"inputs": rest * x * s, "parameters": (m - 1) * p_all * s,
          "buffers": (m - 1) * f_all * s, "gradients": (m - 1) * p_all * s,
          "activations": 2 * rest * out_classes * s}
    moved = 0
    first = True
    for stage in stages:
        if stage.kind == "local":
            moved += rest * act if first else 0
        else:
            lin = mods[stage.indices[0]]
            sizes = split_sizes(lin.out_features, n)
            k = len(sizes)
            if first:  # every shard gathers the chunks of the other replicas
                moved += sum(batch - chunks[j] for j in range(k)) * lin.in_features
            else:
                moved += (k - 1) * batch * lin.in_features
            if stage.kind == "column":
                moved += batch * (lin.out_features - sizes[0])
            else:
                moved += (k - 1) * batch * mods[stage.indices[-1]].out_features
        first = False
    hybrid = dict(dp, parameters=(m - 1) * p_trunk * s, buffers=(m - 1) * f_trunk * s,
                  gradients=(m - 1) * p_trunk * s, activations=2 * moved * s)
    return dp, hybrid


def _layout_rows(head: nn.Module, name: str, leading, stages, n: int) -> list[str]:
    mods = list(head_sequential(head))

    def at(i: int) -> str:  # the layer's name in the model
        return f"{name}.{i}" if isinstance(head, nn.Sequential) else name

    rows = [f"{at(i)} {type(mods[i]).__name__}: per batch chunk, data parallel"
            for i in leading]
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
            for j in stage.indices[1:-1]:
                rows.append(f"{at(j)} {type(mods[j]).__name__}: per shard")
            row = mods[stage.indices[-1]]
            rows.append(f"{at(stage.indices[-1])} Linear {row.in_features}->"
                        f"{row.out_features}: row over {sizes}, partial sums to device 0")
    return rows


def _input_shape(input_size) -> tuple:
    if isinstance(input_size, int):
        return (3, input_size, input_size)
    shape = tuple(int(v) for v in input_size)
    if not shape or any(v < 1 for v in shape):
        raise UsageError(f"input_size must be a side or a (C, H, W) shape, got {input_size!r}")
    return shape


def _device_count(device_ids) -> int:
    """How many devices ``device_ids`` names: an int count, or a device list."""
    if isinstance(device_ids, int) and not isinstance(device_ids, bool):
        if device_ids < 1:
            raise UsageError(f"plan needs at least 1 device, got {device_ids}")
        return device_ids
    return len(resolve_devices(device_ids))


def _traced(model: nn.Module, name: str, shape: tuple) -> tuple[int, int, dict]:
    """Forward MACs per sample of the trunk and of the classifier ``name``, and the per-sample
    sizes of the trunk output (``act``) and the logits (``out``), from one meta-device trace."""
    meta = meta_copy(model)
    seen: dict = {}

    def sizes_hook(mod, args, out):  # per-sample sizes of the trunk output and the logits
        seen["act"], seen["out"] = args[0][0].numel(), out[0].numel()

    hooks = [getattr(meta, name).register_forward_hook(sizes_hook)]
    try:

        macs = mac_breakdown(meta, (1,) + shape)
    finally:
        for h in hooks:
            h.remove()
    mac_cls = sum(v for k, v in macs.items() if k == name or k.startswith(name + "."))
    return sum(macs.values()) - mac_cls, mac_cls, seen


def _break_even(batch_size: int, common: dict) -> int | None:
    """The largest batch at which hybrid still moves fewer bytes than data parallel (inputs
    aside), when it does at ``batch_size``; else None."""
    def hybrid_cheaper(b: int) -> bool:
        d, h = _bytes(batch=b, **common)
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
    """Cost report for training ``model`` hybrid versus data parallel (see the module doc).

    ``split``: the trunk's batch weights, as ``HybridParallel(split=)`` takes them (default
    even); ``per_sample``: each device's seconds per sample, for the expected step time of
    the split (default: 1 sample-time each; see :func:`tandem.parallel.split.split_report`).

    ``device_ids`` is a device list as everywhere in tandem, or an int count (to plan for
    devices this machine does not have). ``input_size`` is one sample's shape ``(C, H, W)`` or
    a square side. ``head`` names the classifier as for :class:`HybridParallel`. ``model`` is
    not run or modified: a meta-device copy is traced once.
    """
    name = find_head(model, head, who="plan")
    classifier = getattr(model, name)
    n = _device_count(device_ids)
    if batch_size < 1:
        raise UsageError(f"batch_size must be >= 1, got {batch_size}")
    shape = _input_shape(input_size)
    weights = None if split is None else check_weights(split, n)
    leading, stages = classifier_layout(head_sequential(classifier))
    mac_trunk, mac_cls, seen = _traced(model, name, shape)

    def count(tensors):
        return sum(t.numel() for t in tensors if t.is_floating_point())

    p_all, p_cls = count(model.parameters()), count(classifier.parameters())
    f_all, f_cls = count(model.buffers()), count(classifier.buffers())
    first = next(model.parameters(), None)
    s = first.element_size() if first is not None else 4
    common = dict(n=n, s=s, x=int(torch.Size(shape).numel()), out_classes=seen["out"],
                  p_all=p_all, f_all=f_all, p_trunk=p_all - p_cls, f_trunk=f_all - f_cls,
                  act=seen["act"], stages=stages, mods=list(head_sequential(classifier)),
                  weights=weights)
    dp, hybrid = _bytes(batch=batch_size, **common)
    return HybridPlan(
        model=type(model).__name__, batch_size=batch_size, num_devices=n, input_size=shape,
        bytes_per_element=s, params_trunk=p_all - p_cls, params_classifier=p_cls,
        macs_trunk=mac_trunk * batch_size, macs_classifier=mac_cls * batch_size,
        layout=_layout_rows(classifier, name, leading, stages, n),
        dp_bytes=dp, hybrid_bytes=hybrid, break_even_batch=_break_even(batch_size, common),
        split=split_report(batch_size, n, weights, per_sample,
                           int(torch.Size(shape).numel()) * s, unit))
