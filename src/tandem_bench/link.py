"""What the link costs a step: the bytes each process sends under ddp and under the hybrid
across processes (:func:`tandem.hybrid.cost.step_bytes`), and the communication time
they take at a link rate: ``--link-rate``, or the one a short all-reduce measures in the bench's
torchrun phase (:func:`tandem.strategies.auto.link_rate`).

A prediction is the busiest rank's bytes over the rate: no overlap with compute, no latency.
Nothing here runs the model; ``tandem bench --explain`` prints :meth:`LinkPlan.report` before
the race and :meth:`LinkPlan.measured_line` after it, and the JSON keeps :meth:`LinkPlan.record`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from torch import nn

from tandem.distributed.compression import Compression
from tandem.errors import UsageError, param
from tandem.hybrid.cost import ProcessBytes, step_bytes
from tandem.strategies import strategy_class
from tandem.strategies.auto import across_processes, launched

# bits per second, any case ("100mbit", "1Gbit/s"); bytes per second, as written ("12.5MB/s")
_BITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_BYTES = {"B": 1, "kB": 1e3, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
          "KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": 2 ** 30, "TiB": 2 ** 40}
_RATE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)(?:e([+-]?\d+))?\s*([A-Za-z]+)(/s)?\s*")
_EXAMPLES = "e.g. 100mbit, 1gbit or 12.5MB/s"
#: what ``--explain`` says ddp's ``--grad-compression`` would send
COMPRESSIONS = ("bf16", "powersgd:1", "powersgd:4")


def parse_rate(text: str, name: str = "link_rate") -> float:
    """``"100mbit"`` -> ``12.5e6`` bytes per second. Bits: ``bit``, ``kbit``, ``mbit``,
    ``gbit``, ``tbit`` (any case); bytes: ``B``, ``kB``/``KB``, ``MB``, ``GB``, ``TB`` (powers
    of 1000) and ``KiB`` ... ``TiB`` (of 1024), as written; ``/s`` optional. A bare number or
    an ambiguous unit (``mb``, ``mbps``) is refused in one line naming parameter ``name``."""
    match = _RATE.fullmatch(str(text))
    unit = match and match.group(3)
    scale = None
    if unit:
        scale = (_BITS[unit.lower()] / 8 if unit.lower() in _BITS else _BYTES.get(unit))
    if scale is None:
        raise UsageError(f"bad {param(name)} {text!r}: give a rate with its unit, {_EXAMPLES}")
    rate = float(f"{match.group(1)}e{match.group(2) or 0}") * scale  # 1e999: inf, refused
    if not (rate > 0 and math.isfinite(rate)):
        raise UsageError(f"bad {param(name)} {text!r}: must be > 0 and finite")
    return rate


def format_rate(bytes_per_s: float) -> str:
    """``12.5e6`` -> ``"100 Mbit/s"``."""
    bits = bytes_per_s * 8
    for unit, size in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= size:
            return f"{bits / size:.3g} {unit}"
    return f"{bits:.3g} bit/s"


def link_pair() -> tuple[str, str | None]:
    """The two multi-process strategies a link's cost compares: the plain one (every gradient
    all-reduced) and the one that splits the model's head across the processes."""
    return launched(), across_processes("hybrid")


def _duration(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.3g} ms"


@dataclass(frozen=True)
class LinkPlan:
    """The bytes each of ``processes`` ranks sends in a step of ``batch_size``, ddp's and the
    hybrid's (``cost``), or why there is no plan (``why_not``: the model has no head to split,
    and ddp's bytes are then not planned either)."""

    model: str
    batch_size: int
    processes: int
    cost: ProcessBytes | None
    why_not: str | None = None
    compressed: dict | None = None  # ddp's busiest rank's bytes a step per --grad-compression

    @property
    def names(self) -> tuple[str, str]:
        """The multi-process strategies planned: the plain one (ddp) and the hybrid's form."""
        return link_pair()

    def busiest(self) -> dict[str, dict[str, float]]:
        """Per strategy, the busiest rank's bytes by kind (``{}`` without a plan)."""
        if self.cost is None:
            return {}
        return {name: dict(self.cost.busiest(rows))
                for name, rows in zip(self.names, (self.cost.ddp, self.cost.hybrid))}

    def totals(self) -> dict[str, float]:
        """Per strategy, the busiest rank's bytes a step (``{}`` without a plan)."""
        return {name: sum(kinds.values()) for name, kinds in self.busiest().items()}

    def seconds(self, bytes_per_s: float | None) -> dict[str, float] | None:
        """Per strategy, the communication seconds a step at ``bytes_per_s`` (``None``: no
        rate, or 0, what one process measures: it sends nothing)."""
        if not bytes_per_s or self.cost is None:
            return None
        return {name: total / bytes_per_s for name, total in self.totals().items()}

    def record(self, given: float | None, measured: float | None) -> dict:
        """What the bench's JSON keeps (``link``): the plan, the rates (bytes per second;
        ``given``: ``--link-rate``, ``measured``: the torchrun phase's all-reduce) and the
        seconds each predicts."""
        return {"model": self.model, "batch_size": self.batch_size,
                "processes": self.processes,
                "bytes_per_step": {name: {"total": round(sum(kinds.values())),
                                          "by_kind": {k: round(v) for k, v in kinds.items()}}
                                   for name, kinds in self.busiest().items()},
                "not_planned": self.why_not,
                "compressed_bytes_per_step": {mode: round(total) for mode, total in
                                              (self.compressed or {}).items()},
                "rates_bytes_per_s": {"given": given, "measured": measured},
                "predicted_s": {"given": self.seconds(given),
                                "measured": self.seconds(measured)}}

    def _times(self, bytes_per_s: float) -> str:
        times = self.seconds(bytes_per_s)
        ddp, hybrid = (times[name] for name in self.names)
        ratio = f" ({hybrid / ddp:.2f}x {self.names[0]}'s)" if ddp > 0 else ""
        return (f"{self.names[0]} {_duration(ddp)}, {self.names[1]} {_duration(hybrid)}"
                f"{ratio} of communication a step")

    def report(self, given: float | None = None) -> str:
        """``--explain`` before the race: the bytes each process sends, and at ``given``
        (``--link-rate``) the time they take."""
        if self.cost is None:
            return (f"bytes sent per step per process: {self.model}, no plan: "
                    f"{self.names[1]} {self.why_not}")
        lines = [self.cost.report()]
        if self.processes < 2:
            lines.append("link: one process sends nothing (--link-processes N plans N)")
        elif given is not None:
            lines.append(f"link at {format_rate(given)} (--link-rate): {self._times(given)} "
                         "(the busiest rank's bytes over the rate, no overlap with compute)")
        else:
            lines.append(f"link: give --link-rate ({_EXAMPLES}) for the time these bytes "
                         "take; a torchrun phase measures this machine's after the race")
        if self.compressed and self.processes >= 2:
            lines.append(self._compressed(given))
        return "\n".join(lines)

    def _compressed(self, given: float | None) -> str:
        """What ddp's ``--grad-compression`` would send a step (and take at ``given``)."""
        exact = self.totals()[self.names[0]]
        at = "" if given is None else f" at {format_rate(given)}"
        rows = ", ".join(f"{mode} {total / 1e6:.3g} MB ({total / exact:.2f}x)" + (
            "" if given is None else f" {_duration(total / given)}")
            for mode, total in self.compressed.items())
        return (f"{self.names[0]} --grad-compression{at}, a lossy update that auto never "
                f"picks: {rows}")

    def measured_line(self, measured: float | None, nproc: int) -> str | None:
        """``--explain`` after the race: the rate the torchrun phase's ``nproc`` processes
        measured and the time the planned bytes take at it; ``None`` when nothing measured
        (0: one process sends nothing)."""
        if not measured:
            return None
        line = (f"link: {format_rate(measured)} measured by an all-reduce in the torchrun "
                f"phase ({nproc} processes on this machine)")
        if self.cost is None or self.processes < 2:
            return line
        return f"{line}: {self._times(measured)}"


def plan_link(model: nn.Module, batch_size: int, processes: int,
              head: str | None = None, backend: str = "nccl") -> LinkPlan:
    """The :class:`LinkPlan` of ``model`` over ``backend`` (nothing is run), or one that says why
    there is none."""
    name = type(model).__name__
    why = strategy_class(link_pair()[1]).check_model(model, hybrid_head=head)
    if why:
        return LinkPlan(name, batch_size, processes, None, why)
    compressed = {mode: ProcessBytes.most(step_bytes(
        model, batch_size, processes, head, backend=backend,
        compression=Compression.parse(mode)).ddp) for mode in COMPRESSIONS}
    return LinkPlan(name, batch_size, processes, step_bytes(
        model, batch_size, processes, head, backend=backend), compressed=compressed)
