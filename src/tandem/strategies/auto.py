"""``--strategy auto``: races the strategies that can drive this model here (:func:`candidates`;
under ``tandem launch`` the multi-process ones) on deep copies, timed by :mod:`.step_timer`, and
keeps the fastest or a simpler one within the noise (:func:`choose`). Out of memory drops a
candidate; the RNGs are left as they were, so the run that follows is the run with the choice.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import random
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from tandem.distributed.agree import LOCAL
from tandem.distributed.process_group import backend_for
from tandem.errors import TandemError, UsageError
from tandem.hybrid import plan as hybrid_plan
from tandem.hybrid.cost import step_bytes
from tandem.parallel.work_clock import synchronize

from . import step_timer
from .base import strategy_class, strategy_names

AUTO = "auto"
NOISE = 0.03  # medians closer than this fraction are a tie: the simpler candidate wins
PROCESS_NOISE = 0.10  # across processes a step waits on the link too, a larger noise
MIN_S, EPOCH_SHARE, MAX_S = 5.0, 0.05, 30.0  # the race's time budget (see budget_s)
MIN_ROUNDS, MAX_ROUNDS = 3, 30  # timed rounds: fewer than 3 have no quartiles to judge by
PROCESS_ROUNDS = 5  # timed rounds of a race across processes (--auto-steps to change)
OUT_OF_MEMORY = "out of memory"
_PLAIN_DP = "dp"  # the plan's data-parallel figure: what a choice's bytes are compared with


def is_resolver(name: str) -> bool:
    """Whether ``--strategy name`` is resolved by a race (``auto``) rather than a strategy."""
    return name == AUTO


def launched() -> str:
    """The strategy under ``tandem launch``: one process per device (no race across them)."""
    return strategy_names(multiprocess=True)[0]


def across_processes(name: str) -> str | None:
    """The multi-process strategy computing one-process ``name``'s update, if any."""
    return next((n for n in strategy_names(multiprocess=True)
                 if strategy_class(n).across_processes_of == name), None)


def launchable(name: str) -> bool:
    """Whether ``tandem launch`` can run ``--strategy name`` (``auto``, or a multi-process one)."""
    return (is_resolver(name) or strategy_class(name).multiprocess
            or across_processes(name) is not None)


def check_launchable(name: str, how: str = "`tandem launch -- train`") -> None:
    """Refuse a ``--strategy name`` that is not :func:`launchable` (``how``: what started it)."""
    if launchable(name):
        return
    ok = [n for n in strategy_names() if launchable(n)] + [AUTO]
    raise UsageError(f"{how} needs --strategy {', '.join(ok[:-1])} or {ok[-1]}, not {name}",
                     hint="each process trains its share of every batch; a one-process "
                          "strategy would train N independent copies writing the same files")


def under_launch(name: str) -> str:
    """What ``--strategy name`` runs as under torchrun: a multi-process strategy itself, a
    one-process one its multi-process form, else (``auto`` too) the plain multi-process one."""
    if is_resolver(name):
        return launched()
    return name if strategy_class(name).multiprocess else across_processes(name) or launched()


def simplest_first() -> list[str]:
    """The one-process strategies, simplest first (their registration order)."""
    return strategy_names(multiprocess=False)


def candidates(devices: list, model, options: dict | None = None,
               check: Callable[[str], str | None] | None = None, processes: bool = False
               ) -> tuple[list[str], dict[str, str]]:
    """``(raced, not_raced)``: the one-process (``processes``: multi-process) strategies that
    can drive ``model`` on ``devices``, and why each other cannot (``check(name)``: the run's)."""
    raced, left = [], {}
    for name in strategy_names(multiprocess=True) if processes else simplest_first():
        cls = strategy_class(name)
        if len(devices) == 1 and cls.max_devices is None and not processes:
            why = "one device: nothing to spread"
        else:
            why = cls.check_model(model, **(options or {})) or (check(name) if check else None)
        if why:
            left[name] = why
        else:
            raced.append(name)
    return raced, left


def budget_s(epoch_s: float) -> float:
    """The race's seconds: 5 s or 5% of an epoch, whichever is more, never over 30 s."""
    return min(MAX_S, max(MIN_S, EPOCH_SHARE * epoch_s))


@dataclass
class RaceResult:
    """A race: a row per raced candidate (``median_s``..., or ``note``), the choice and why."""

    rows: list[dict]
    rounds: int
    seconds: float
    choice: str = ""
    reason: str = ""
    not_raced: dict[str, str] = field(default_factory=dict)
    over_budget: bool = False  # the cold round used the budget: MIN_ROUNDS ran anyway
    asked: int | None = None  # --auto-steps, where fewer than MIN_ROUNDS (raised to it)
    raced: list[str] = field(default_factory=list)  # the candidates, in the order they ran
    planned: dict[str, int] = field(default_factory=dict)  # bytes per step the plan predicts
    link_bytes_per_s: float | None = None  # what a short all-reduce measured (processes)

    def record(self) -> dict:
        """What the run's config keeps (``resolved.auto``)."""
        return {"choice": self.choice, "reason": self.reason, "rounds": self.rounds,
                "over_budget": self.over_budget, "planned_bytes": dict(self.planned),
                "link_bytes_per_s": self.link_bytes_per_s,
                "seconds": round(self.seconds, 3), "table": self.rows,
                "not_raced": dict(self.not_raced)}


@contextlib.contextmanager
def rng_kept():
    """Leave torch's (CPU and every CUDA device's), numpy's and Python's RNGs as they were."""
    py, npy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=list(range(torch.cuda.device_count()))):
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)


def _dropped(name: str, why: str = OUT_OF_MEMORY) -> dict:
    return {"name": name, "note": f"dropped: {why}"}


def _row(lane) -> dict:
    """A lane as the race's table keeps it: the step's median and quartiles, or why dropped."""
    if lane.failure is not None:
        oom = lane.failure.startswith("OutOfMemoryError")
        return _dropped(lane.name, OUT_OF_MEMORY if oom else f"failed ({lane.failure})")
    q1, median, q3 = step_timer.quartiles(lane.times)
    return {"name": lane.name, "median_s": median, "iqr_s": q3 - q1, "q1_s": q1, "q3_s": q3}


def race(names: list[str], place: Callable[[str], Callable[[], step_timer.StrategyStep]], *,
         rounds: int | None = None, epoch_batches: int = 1,
         clock: Callable[[], float] | None = None, agreement=LOCAL,
         agree: Callable[[dict], dict] | None = None) -> RaceResult:
    """Race ``names`` (``place(name)`` puts one on its devices, no collective, and returns what
    launches it): a cold round, then the rounds :func:`budget_s` leaves, or ``rounds`` after a
    warm-up; at least :data:`MIN_ROUNDS`. Across processes every rank races what every rank
    placed, and ``agree(rows)``, called while the candidates stand, gives the rows to decide on."""
    clock = clock or step_timer.clock
    start = clock()
    lanes, rows, ready = [], {}, {}
    with rng_kept():
        try:
            for name in names:
                try:
                    ready[name] = place(name)
                except torch.OutOfMemoryError:
                    rows[name] = _dropped(name)
            everywhere = agreement.all_of([n in ready for n in names])
            for name, kept in zip(names, everywhere):
                if name not in ready:
                    continue
                candidate = ready.pop(name)
                if not kept:  # placed here, not on another rank: no rank launches it
                    rows[name] = _dropped(name, f"{OUT_OF_MEMORY} on another rank")
                    continue
                step = candidate()
                lanes.append(step_timer.Lane(name, step, step.devices))
            if rounds is None:  # one cold round, never the one that decides
                step_timer.interleave(lanes, 1, clock=clock)
                n = _rounds(lanes, clock() - start, epoch_batches)
                over_budget, n = n < MIN_ROUNDS, max(MIN_ROUNDS, n)
                for lane in lanes:
                    lane.times.clear()
                step_timer.interleave(lanes, n, clock=clock)
            else:
                over_budget, n = False, max(MIN_ROUNDS, rounds)
                step_timer.interleave(lanes, n, 1, clock=clock, catch=agree is None)
            rows.update((lane.name, _row(lane)) for lane in lanes)
            if agree is not None:
                rows = agree(rows)
        finally:
            ready.clear()
            for lane in reversed(lanes):  # the last launched leaves first: the groups the
                lane.step.close()         # first one joined outlive the later ones' reducers
                lane.step = None  # the copies go before the run builds its own
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return RaceResult([rows[n] for n in names if n in rows], n, clock() - start,
                      over_budget=over_budget,
                      asked=rounds if rounds is not None and rounds < MIN_ROUNDS else None)


def _rounds(lanes: list, elapsed: float, epoch_batches: int) -> int:
    """Rounds that fit what the budget leaves after ``elapsed`` seconds (0: none left)."""
    steps = [lane.times[0] for lane in lanes if lane.failure is None and lane.times]
    if not steps:
        return 0
    left = budget_s(epoch_batches * min(steps)) - elapsed
    per_round = sum(steps)
    return max(0, min(MAX_ROUNDS, math.floor(left / per_round))) if per_round > 0 else MAX_ROUNDS


def resolve(devices: list, model, batch: tuple[torch.Tensor, torch.Tensor], *,
            options: dict | None = None, check: Callable[[str], str | None] | None = None,
            rounds: int | None = None, epoch_batches: int = 1, clock=None,
            split=None, agreement=LOCAL, amp=None, lr: float = 0.1, **step) -> RaceResult:
    """``auto`` resolved for ``model`` on ``devices`` and the global ``batch``: :func:`candidates`
    raced on copies, then :func:`choose` (``step``: :func:`~.step_timer.placed` keywords). Across
    processes all race the same rounds (no budget), an all-reduce measures the link, and rank
    0's table decides."""
    processes = agreement.world_size
    names, not_raced = candidates(devices, model, options, check, processes=processes > 1)
    if not names:
        raise UsageError("--strategy auto: no strategy can run this here: " + "; ".join(
            f"{n}: {why}" for n, why in not_raced.items()))

    def place(name: str) -> Callable[[], step_timer.StrategyStep]:
        few = devices[:strategy_class(name).max_devices or len(devices)]
        ready = step_timer.placed(name, copy.deepcopy(model), few, batch, split=split,
                                  options=options, agreement=agreement, **step)
        return lambda: step_timer.StrategyStep.start(ready, amp=amp, lr=lr)

    link: dict = {}

    def agree(rows: dict) -> dict:  # the candidates still stand, each rank's table timed
        rows, link["rate"] = agreement.from_rank0((rows, link_rate()))
        return rows

    images = batch[0]
    if len(names) == 1:  # nothing to race
        result = RaceResult([], 0, 0.0)
    elif processes > 1:
        result = race(names, place, rounds=process_rounds(rounds), clock=clock,
                      agreement=agreement, agree=agree)
    else:
        result = race(names, place, rounds=rounds, clock=clock, epoch_batches=epoch_batches)
    head = (options or {}).get("hybrid_head")
    result.planned = (planned_process_bytes(model, len(images), processes, head,
                                            backend=wire_backend(devices[0]))
                      if processes > 1 else
                      planned_bytes(model, devices, len(images), tuple(images.shape[1:]), head,
                                    split))
    result.link_bytes_per_s = link.get("rate")
    noise = PROCESS_NOISE if processes > 1 else NOISE
    result.choice, result.reason = (choose(result.rows, result.planned, noise) if result.rows else
                                    (names[0], f"{names[0]}: the only candidate"))
    result.not_raced, result.raced = not_raced, names
    return result


def process_rounds(asked: int | None) -> int:
    """A race across processes' timed rounds: ``--auto-steps`` (at least 3), else 5."""
    return max(MIN_ROUNDS, asked or PROCESS_ROUNDS)


def process_race_line(processes: int, asked: int | None) -> str:
    """The line said before a race across ``processes`` starts: its rounds, unbounded in time."""
    return (f"strategy auto: racing across {processes} processes, {process_rounds(asked)} timed "
            f"rounds of each candidate after one warm-up, however long they take (no time "
            f"budget across processes; --auto-steps N for fewer or more)")


def link_rate(nbytes: int = 8_000_000, repeats: int = 3) -> float:
    """Bytes per second each process sends in a ring all-reduce of ``nbytes`` on the job's
    group (the fastest of ``repeats``, after one untimed)."""
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend() == "nccl" else torch.device("cpu"))
    tensor = torch.zeros(nbytes // 4, device=device)
    world = dist.get_world_size()
    best = math.inf
    for i in range(repeats + 1):
        synchronize([device])
        start = step_timer.clock()
        dist.all_reduce(tensor)
        synchronize([device])
        if i:
            best = min(best, step_timer.clock() - start)
    sent = 2 * (world - 1) / world * nbytes
    return sent / best if best > 0 else math.inf


def wire_backend(device) -> str:
    """The backend :func:`~tandem.hybrid.cost.step_bytes` counts for a run on ``device``."""
    return "gloo" if backend_for(torch.device(device)) == "gloo" else "nccl"


def planned_process_bytes(model, batch_size: int, processes: int, head: str | None = None,
                          backend: str = "nccl") -> dict[str, int]:
    """The busiest process's bytes a step over ``backend`` by multi-process strategy
    (:func:`~tandem.hybrid.cost.step_bytes`); ``{}`` if it cannot plan."""
    try:
        cost = step_bytes(model, batch_size, processes, head, backend=backend)
    except _CANNOT_PLAN:
        return {}
    return _registered({launched(): round(cost.most(cost.ddp)),
                        across_processes("hybrid"): round(cost.most(cost.hybrid))})


_CANNOT_PLAN = (TandemError, ValueError, TypeError, AttributeError)


def _registered(predicted: dict) -> dict:
    return {n: v for n, v in predicted.items() if n in strategy_names()}


def _tied(a: dict, b: dict, noise: float = NOISE) -> bool:
    close = abs(a["median_s"] - b["median_s"]) <= noise * min(a["median_s"], b["median_s"])
    return close or (a["q1_s"] <= b["q3_s"] and b["q1_s"] <= a["q3_s"])


def choose(rows: list[dict], planned: dict | None = None, noise: float = NOISE) -> tuple[str, str]:
    """``(name, reason)``: the shortest median step, or the simplest candidate within
    ``noise`` of it (medians or quartiles); ``planned`` (:func:`planned_bytes`) adds bytes."""
    timed = {r["name"]: r for r in rows if "median_s" in r}
    if not timed:
        raise RuntimeError("--strategy auto: every candidate failed: " + "; ".join(
            f"{r['name']} {r['note']}" for r in rows))
    order = [n for n in simplest_first() if n in timed] + \
        [n for n in timed if n not in simplest_first()]
    fastest = min(order, key=lambda n: timed[n]["median_s"])
    tied = [n for n in order if n == fastest or _tied(timed[n], timed[fastest], noise)]
    pick = tied[0]
    others = [n for n in order if n != pick]
    if not others:
        return pick, f"{pick}: the only candidate left"
    if pick != fastest:
        ratio = timed[pick]["median_s"] / timed[fastest]["median_s"]
        return pick, (f"{pick}: the race could not tell {_and(tied)} apart (its step "
                      f"{ratio:.2f}x {fastest}'s, within the noise), and it is the simplest")
    rival = min(others, key=lambda n: timed[n]["median_s"])
    reason = f"{pick}: {timed[rival]['median_s'] / timed[pick]['median_s']:.2f}x {rival}"
    planned = planned or {}
    ref = next((n for n in (rival, _PLAIN_DP) if n != pick and planned.get(n)), None)
    if planned.get(pick) and ref:  # single moves nothing: no ratio to give
        reason += f", {planned[pick] / planned[ref]:.2f}x the bytes {ref} plans"
    if len(tied) > 1:
        reason += f"; the race could not tell {_and(tied)} apart, and {pick} is the simplest"
    return pick, reason


def _and(names: list[str]) -> str:
    return " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)


def planned_bytes(model, devices: list, batch_size: int, input_size, head: str | None = None,
                  split=None) -> dict[str, int]:
    """Bytes a step moves between devices, inputs in, as :func:`tandem.hybrid.plan` predicts
    (balanced: dp's less the gathered logits); ``{}`` for a model it cannot plan."""
    try:
        p = hybrid_plan(model, devices, batch_size=batch_size, input_size=input_size, head=head,
                        split=None if split == "auto" else split)
    except _CANNOT_PLAN:
        return {}
    dp = sum(p.dp_bytes.values())
    return _registered({"single": 0, "dp": dp, "balanced": dp - p.dp_bytes.get("activations", 0),
                        "hybrid": sum(p.hybrid_bytes.values())})


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:.2f} MB"


def format_block(result: RaceResult, planned: dict | None = None, title: str = "") -> str:
    """The table (each step's median, quartiles and their spread) and the choice, one block."""
    planned = planned or {}
    rounds = f"{result.rounds} timed round{'s' if result.rounds != 1 else ''}"
    if result.over_budget:
        rounds += f" (past the budget: a race decides on {MIN_ROUNDS} warm rounds at least)"
    elif result.asked is not None:
        rounds += f" (--auto-steps {result.asked} raised to {MIN_ROUNDS}: fewer never decide)"
    lines = [f"strategy auto: {title}" + (f"{rounds} in {result.seconds:.1f} s" if result.rows
                                          else "no race: one candidate"),
             f"  {'candidate':<10}{'step ms':>9}{'spread':>8}{'q1-q3 ms':>17}  "
             f"planned bytes/step"]
    for row in result.rows:
        if "median_s" in row:
            median, q1, q3 = (row[k] * 1e3 for k in ("median_s", "q1_s", "q3_s"))
            share = f"{(q3 - q1) / median:.0%}" if median > 0 else "-"
            lines.append(f"  {row['name']:<10}{median:>9.1f}{share:>8}"
                         f"{f'{q1:.1f}-{q3:.1f}':>17}  {_mb(planned.get(row['name']))}")
        else:
            lines.append(f"  {row['name']:<10}{row['note']}")
    for name, why in result.not_raced.items():
        lines.append(f"  {name:<10}not raced: {why}")
    rate = result.link_bytes_per_s
    if rate and planned:
        cost = ", ".join(f"{n} {b / rate * 1e3:.1f} ms" for n, b in planned.items())
        lines.append(f"  link: {rate * 8 / 1e6:.0f} Mbit/s measured by an all-reduce; the "
                     f"planned bytes take {cost} a step at that rate")
    lines.append(f"  chosen: {result.reason}")
    return "\n".join(lines)
