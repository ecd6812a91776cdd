"""Bytes per training step that each process sends: ddp versus the hybrid across processes.

What travels, per rank ``r`` of ``W``, rows ``s_r`` of the global batch (the loader's shares),
``m`` the largest share, ``e`` bytes per element, as bandwidth-optimal algorithms send it (ring
all-reduce, all-gather and reduce-scatter, pairwise all-to-all):

- ddp: every parameter's gradient all-reduced, ``2 (W-1)/W P e``;
- hybrid (:class:`~.across_processes.DistributedHybrid`): the data-parallel parameters'
  gradients the same way, and the head's activations, forward and backward: a column layer's
  input gathered (``(W-1) m in e`` each way), a row layer's output reduce-scattered (``(W-1) m out
  e`` each way, in float32 at least), a gathered column layer's blocks exchanged (``(N - s_r)
  c_r e`` forward, ``s_r (out - c_r) e`` back, ``c_r`` the rank's block).

Summed over ranks, these are the one-process plan's figures (:func:`~.cost.plan`, ``tandem
bench --explain``): ddp's ``gradients + parameters``, hybrid's ``activations`` when the batch
and the split features divide evenly (the plan keeps block 0 on the output device, so it
counts one block less when they do not). Not counted: BatchNorm buffers DDP broadcasts under
``--buffers replica0`` (``(W-1)/W`` of them, average per rank, given as ``buffers``), and the few
bytes of the loss and the shares.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from tandem.errors import UsageError

from ..parallel.shares import shares as cut
from .across_processes import block_sizes
from .layout import classifier_layout, find_head, head_sequential

__all__ = ["ProcessBytes", "step_bytes", "KINDS"]

#: what the figures are made of, in report order
KINDS = ("gradients", "buffers", "activations", "activation_grads")


@dataclass
class ProcessBytes:
    """Bytes each rank sends in one training step, ddp and hybrid, by kind (:data:`KINDS`)."""

    model: str
    batch_size: int
    processes: int
    ddp: list[dict]
    hybrid: list[dict]

    @staticmethod
    def most(rows: list[dict]) -> float:
        """The busiest rank's bytes in ``rows`` (:attr:`ddp` or :attr:`hybrid`): what a link
        carrying every rank's traffic waits for."""
        return max(sum(row.values()) for row in rows)

    def seconds(self, bytes_per_s: float) -> tuple[float, float]:
        """Predicted communication seconds per step at a link of ``bytes_per_s``, ddp's and
        hybrid's (the busiest rank's bytes over the rate; no overlap with compute assumed)."""
        return self.most(self.ddp) / bytes_per_s, self.most(self.hybrid) / bytes_per_s

    def report(self) -> str:
        mb = 1e6
        lines = [f"bytes sent per step per process: {self.model}, batch {self.batch_size} over "
                 f"{self.processes} processes (busiest rank)",
                 f"{'MB':<22}{'data parallel':>14}{'split head':>12}"]
        for kind in KINDS:
            d = max(row.get(kind, 0) for row in self.ddp)
            h = max(row.get(kind, 0) for row in self.hybrid)
            lines.append(f"  {kind:<20}{d / mb:>14.2f}{h / mb:>12.2f}")
        lines.append(f"  {'total':<20}{self.most(self.ddp) / mb:>14.2f}"
                     f"{self.most(self.hybrid) / mb:>12.2f}")
        return "\n".join(lines)

    __str__ = report


def _count(tensors) -> int:
    return sum(t.numel() for t in tensors if t.is_floating_point())


def _head_bytes(stages, mods, shares: list[int], rank: int, e: int) -> tuple[int, int]:
    """(forward, backward) bytes rank ``rank`` sends for the head's activations."""
    world, most = len(shares), max(shares)
    work = max(e, 4)  # partial sums travel in float32 at least
    n, mine = sum(shares), shares[rank]
    fwd = bwd = 0
    for stage in stages:
        if stage.kind == "local":
            continue
        lin = mods[stage.indices[0]]
        gathered = (world - 1) * most * lin.in_features * e  # its input, and its gradient back
        fwd, bwd = fwd + gathered, bwd + gathered
        if stage.kind == "column":
            cols = block_sizes(lin.out_features, world)[rank]
            fwd += (n - mine) * cols * e
            bwd += mine * (lin.out_features - cols) * e
        else:
            summed = (world - 1) * most * mods[stage.indices[-1]].out_features * work
            fwd, bwd = fwd + summed, bwd + summed
    return fwd, bwd


def step_bytes(model: nn.Module, batch_size: int, processes: int,
               head: str | None = None) -> ProcessBytes:
    """What each of ``processes`` ranks sends in one step of ``batch_size`` global samples
    (see the module docstring), from ``model``'s parameters and its head's layout (nothing
    is run); ``head`` names the classifier."""
    if processes < 1 or batch_size < 1:
        raise UsageError(f"step_bytes needs a batch and processes >= 1, got batch "
                         f"{batch_size} over {processes}")
    name = find_head(model, head, who="step_bytes")
    shares = cut(batch_size, [1] * processes)  # the loader's, some maybe empty
    first = next(model.parameters(), None)
    e = first.element_size() if first is not None else 4
    mods = list(head_sequential(getattr(model, name)))
    _, stages = classifier_layout(head_sequential(getattr(model, name)))
    split = [mods[i] for s in stages if s.kind != "local" for i in (s.indices[0], s.indices[-1])]
    p_all, f_all = _count(model.parameters()), _count(model.buffers())
    p_split = _count({id(p): p for m in split for p in m.parameters()}.values())
    w = processes
    ring, bcast = 2 * (w - 1) / w, (w - 1) / w
    ddp = [{"gradients": ring * p_all * e, "buffers": bcast * f_all * e}] * w
    hybrid = []
    for rank in range(w):
        fwd, bwd = _head_bytes(stages, mods, shares, rank, e)
        hybrid.append({"gradients": ring * (p_all - p_split) * e,
                       "buffers": bcast * f_all * e,  # split layers hold none
                       "activations": fwd, "activation_grads": bwd})
    return ProcessBytes(type(model).__name__, batch_size, w, [dict(r) for r in ddp], hybrid)
