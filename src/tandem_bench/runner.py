"""The race: warm up every contestant, then time them interleaved, round by round.

The order rotates every round, so machine noise hits every contestant alike; the clock is read
only after :func:`~tandem_bench.timing.synchronize`. Every result has the keys in
:data:`RESULT_FIELDS`, whether it ran, was skipped or failed.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Sequence


from tandem.parallel.traffic import TrafficMeter
from tandem.strategies import strategy_names

from tandem.strategies.step_timer import Lane, clock, describe, interleave

from .contestants import Contestant
from .entry import Entry
from .timing import MemoryProbe, summarize

RESULT_FIELDS = (
    "name",               # "single", "dp", ..., "bare", "torch_dp", "torch_ddp"
    "kind",               # "strategy" or "baseline"
    "status",             # "ok", "skipped" or "failed"
    "reason",             # why skipped or failed, else None
    "phase",              # "interleaved" (this process) or "torchrun" (separate processes)
    "devices",            # device strings, one per replica or process
    "steps",              # timed steps
    "step_time_s",        # {median, q1, q3, iqr, min, max, mean, n}
    "images_per_sec",     # {median, q1, q3}: batch / step time at the time's median, q3, q1
    "speedup_vs_single",  # single's median step time / this one's (> 1 is faster)
    "speedup_vs_bare",    # bare's median step time / this one's
    "speedup_vs_eager",   # for a "<name>+compile" twin: <name>'s median step time / this one's
    "speedup_vs_plain",   # for a "<base>+..." twin (--variants, +compile): <base>'s / this one's
    "loop_over_step",     # for a "<name>/loop" twin (--loop): this one's median / <name>'s
    "first_step_s",       # the first, untimed step: for a compiled twin, mostly compile time
    "bytes_per_step",     # {total, by_kind, by_dst, uncounted}: tandem's engine count, else None
    "peak_memory_bytes",  # one entry per device; None where the device reports nothing
    "last_loss",          # loss of the last step (a finite number means it trained)
    "notes",              # list of remarks (threads, phase, ...)
)


def empty_result(name: str, kind: str, devices: Sequence, status: str = "skipped",
                 reason: str | None = None, phase: str | None = None) -> dict:
    """A result with every field present: what a skipped or failed contestant reports."""
    result = dict.fromkeys(RESULT_FIELDS)
    result.update(name=name, kind=kind, status=status, reason=reason, phase=phase,
                  devices=[str(d) for d in devices], steps=0,
                  peak_memory_bytes=[None] * len(devices), notes=[])
    return result


@dataclass
class _Lane(Lane):
    """What the race tracks for one contestant, beyond a step timer's lane: the contestant,
    its traffic and its memory."""

    contestant: Contestant | None = None
    meter: TrafficMeter = field(default_factory=TrafficMeter)
    probe: MemoryProbe | None = None


@contextlib.contextmanager
def _measured(lane: _Lane, timed: bool):
    """Around one step: the memory probe and (where the engine counts it) the traffic meter,
    only in timed rounds."""
    if timed:
        lane.probe.start()
    counted = timed and lane.contestant.counts_traffic
    with lane.meter if counted else contextlib.nullcontext():
        yield
    if timed:
        lane.probe.stop()


def race(contestants: Sequence[Contestant], steps: int, warmup: int, batch_size: int, *,
         phase: str = "interleaved", catch: bool = True, clock=clock) -> list[dict]:
    """Run ``warmup`` untimed then ``steps`` timed rounds, interleaved as the step timer does
    (:func:`~tandem.strategies.step_timer.interleave`); return one result per contestant.

    Where memory is reported, each contestant runs one extra untimed step alone first
    (:class:`~tandem_bench.timing.MemoryProbe`). With ``catch`` a failing contestant is marked
    ``failed`` and the others go on; without it the error propagates (torchrun ranks need that).
    ``clock`` reads seconds (injectable for tests).
    """
    lanes = [_Lane(c.name, c.step, c.devices, contestant=c, probe=MemoryProbe(c.devices))
             for c in contestants if c.skipped is None and c.failure is None]
    for lane in lanes:  # devices that report memory: one untimed priming step each
        if lane.probe.active:
            try:
                start = clock()
                lane.loss = lane.probe.prime(lane.contestant.step, lane.contestant.own_tensors())
                lane.first_s = clock() - start
            except Exception as exc:
                if not catch:
                    raise
                lane.failure = describe(exc)
    interleave(lanes, steps, warmup, clock=clock, catch=catch, around=_measured)
    by_name = {lane.contestant.name: lane for lane in lanes}
    return [_result(c, by_name.get(c.name), steps, batch_size, phase) for c in contestants]


def _per_step(counts: dict, steps: int) -> dict:
    return {("unknown" if k is None else str(k)): round(v / steps) for k, v in counts.items()}


def _result(contestant: Contestant, lane: _Lane | None, steps: int, batch_size: int,
            phase: str) -> dict:
    c = contestant
    if c.skipped is not None:
        return empty_result(c.name, c.kind, c.devices, "skipped", c.skipped)
    if c.failure is not None:
        return empty_result(c.name, c.kind, c.devices, "failed", c.failure, phase)
    if lane.failure is not None:
        result = empty_result(c.name, c.kind, c.devices, "failed", lane.failure, phase)
        result["notes"] = list(c.notes)
        return result
    stats = summarize(lane.times)
    result = empty_result(c.name, c.kind, c.devices, "ok", None, phase)
    result.update(
        steps=stats.n,
        step_time_s=stats.as_dict(),
        images_per_sec={"median": batch_size / stats.median, "q1": batch_size / stats.q3,
                        "q3": batch_size / stats.q1},
        peak_memory_bytes=lane.probe.per_device(),
        last_loss=float(lane.loss.float().item()),
        first_step_s=lane.first_s,
        notes=list(c.notes),
    )
    if c.counts_traffic:
        result["bytes_per_step"] = {
            "total": round(lane.meter.total / stats.n),
            "by_kind": _per_step(lane.meter.by_kind, stats.n),
            "by_dst": _per_step(lane.meter.by_dst, stats.n),
            "uncounted": c.uncounted_traffic,
        }
    if not math.isfinite(result["last_loss"]):
        result["notes"].append("loss is not finite")
    return result


def add_ratios(results: list[dict], entries: Sequence[Entry]) -> list[dict]:
    """Fill ``speedup_vs_single``, ``_vs_bare``, (twins) ``_vs_eager`` and ``_vs_plain``, and
    (loop twins) ``loop_over_step`` from median times; ``entries`` are the results' contestants."""
    medians = {r["name"]: r["step_time_s"]["median"] for r in results if r["status"] == "ok"}
    by_name = {entry.name: entry for entry in entries}
    for result in results:
        if result["status"] != "ok":
            continue
        own = result["step_time_s"]["median"]
        for ref in (*strategy_names(reference=True), "bare"):
            if ref in medians:
                result[f"speedup_vs_{ref}"] = medians[ref] / own
        entry = by_name[result["name"]]
        if entry.loop:  # the train loop's own cost next to the bench step it runs
            step = entry.step_twin().name
            if step in medians:
                result["loop_over_step"] = own / medians[step]
            continue
        eager = entry.eager_twin().name
        if eager != entry.name and eager in medians:
            result["speedup_vs_eager"] = medians[eager] / own
        plain = entry.plain_twin().name  # fp32, contiguous, eager
        if plain != entry.name and plain in medians:
            result["speedup_vs_plain"] = medians[plain] / own
    return results
