"""Turning a bench report (the dict from :func:`~tandem_bench.suite.run_bench`) into text.

Per contestant: median step time and spread, images/s, speed-ups against ``single`` and
``bare``, bytes moved and peak memory ("n/a": the device reports none); with ``--loop`` each
loop twin against its bench step. The JSON is unrounded. A row whose step times spread
more than half their median between quartiles is marked ``!`` (noise), a loop twin faster than
its own bench step ``?`` (it cannot be), and a line under the table says so.
"""

from __future__ import annotations

import json
import sys
from typing import TextIO

import torch

from tandem.config import flagged
from tandem.distributed.env import Environment, malloc_left_alone
from tandem.errors import TandemError, first_line
from tandem.hybrid import plan
from tandem.parallel import threaded_backward
from tandem.parallel.split import split_gain, split_report
from tandem.precision import amp_precision
from tandem.strategies import strategy_names

from .entry import LOOP
from .timing import IMPOSSIBLE, impossible, impossible_lines, is_noise, noise_lines


def format_bytes(n: float | None) -> str:
    """``1536`` -> ``"1.5K"``; ``None`` -> ``"n/a"``."""
    if n is None:
        return "n/a"
    for unit in ("", "K", "M", "G", "T"):
        if abs(n) < 1024 or unit == "T":
            return f"{n:.0f}{unit}" if unit == "" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}T"  # unreachable; keeps linters quiet


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


# a speed-up over single this far beyond the contestant's device count is not believed
BEYOND_LINEAR = 1.1


def beyond_linear(r: dict) -> bool:
    """True when row ``r``, on N >= 2 devices (replicas or processes), claims more speed over
    ``single`` than they can give: N devices make a step at most about N times faster than
    one, so such a ratio says that single's time, or this one's, was disturbed (a loaded
    machine). One device against another (bare vs single) is an overhead, not a bound."""
    gain, devices = r.get("speedup_vs_single"), len(r.get("devices") or ())
    return gain is not None and devices >= 2 and gain > BEYOND_LINEAR * devices


def _row(r: dict) -> list[str]:
    name = r["name"] + (" *" if r["kind"] == "baseline" else "")
    if r["status"] == "ok" and is_noise(r["step_time_s"]):
        name += " !"
    if r["status"] != "ok":
        return [name, f"{r['status']}: {r['reason']}"]
    t = r["step_time_s"]
    ratio = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731
    vs_single = ratio(r["speedup_vs_single"]) + (f" {IMPOSSIBLE}" if beyond_linear(r) else "")
    traffic = r["bytes_per_step"]
    if traffic is None:
        moved = "not counted"
    else:
        kinds = ", ".join(f"{k} {format_bytes(v)}" for k, v in sorted(traffic["by_kind"].items()))
        moved = format_bytes(traffic["total"]) + (f" ({kinds})" if kinds else "")
        if traffic.get("uncounted"):
            moved += f" + {traffic['uncounted']} (not counted)"
    memory = " ".join(format_bytes(m) for m in r["peak_memory_bytes"])
    return [name, _ms(t["median"]), _ms(t["iqr"]), f"{_ms(t['min'])}..{_ms(t['max'])}",
            f"{r['images_per_sec']['median']:.1f}", vs_single,
            ratio(r["speedup_vs_bare"]), moved, memory]


HEADER = ["contestant", "step ms", "IQR ms", "min..max ms", "img/s", "vs single", "vs bare",
          "engine bytes/step", "peak mem/device"]


def _precision(c: dict) -> str:
    """The run's --amp or --variants, as ``tandem.precision`` resolves them on its device."""

    # cpu_bf16=True: a report describes the machine it ran on, which had bf16 if it used it
    device_type = c["device_list"][0].split(":")[0]
    if c.get("variants"):
        amp = amp_precision(device_type, True, c["amp_dtype"], cpu_bf16=True).describe() if any(
            "amp" in v for v in c["variants"]) else ""
        return f"variants {','.join(c['variants'])}" + (f" (amp: {amp.removeprefix('amp ')})"
                                                        if amp else "")
    return amp_precision(device_type, c["amp"], c["amp_dtype"], cpu_bf16=True).describe()


def format_table(report: dict) -> str:
    """The human-readable table, with a title line describing the run."""
    c, m = report["config"], report["machine"]
    title = (f"tandem bench: {c['arch']}, global batch {c['batch_size']}, "
             f"{c['image_size']}x{c['image_size']}, devices {c['devices']} "
             f"({len(c['device_list'])}), {c['steps']} timed steps after {c['warmup']} warm-up, "
             f"{_precision(c)}{', channels_last' if c['channels_last'] else ''}"
             f"{', sync-bn' if c['sync_bn'] else ''}; torch {m['torch']}, "
             f"{m['cpu_count']} CPUs, {m['date_utc']}")
    rows = [_row(r) for r in report["results"]]
    full = [r for r in rows if len(r) == len(HEADER)]
    widths = [max(len(x[i]) for x in [HEADER, *full]) for i in range(len(HEADER))]
    widths[0] = max(len(r[0]) for r in [HEADER, *rows])
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(HEADER, widths)).rstrip()]
    for row in rows:
        if len(row) == len(HEADER):
            lines.append("  ".join(x.ljust(w) for x, w in zip(row, widths)).rstrip())
        else:
            lines.append(f"{row[0].ljust(widths[0])}  {row[1]}")
    baseline = any(r["kind"] == "baseline" for r in report["results"])
    lines.append(("* baseline in plain torch. " if baseline else "") +
                 "Ratios are median step times (>1 is faster). "
                 "Bytes are tandem-engine transfers per step (logical, between replicas).")
    lines += _noise_lines(report["results"])
    lines += _beyond_lines(report["results"])
    lines += split_lines(report)
    compiled = [r for r in report["results"] if r["name"].endswith("+compile")
                and r["status"] == "ok" and r.get("first_step_s") is not None]
    if compiled:
        lines.append("compile (first, untimed step; not in step ms or img/s): " + ", ".join(
            f"{r['name']} {r['first_step_s']:.1f}s" for r in compiled))
        lines.append("compiled vs eager: " + ", ".join(
            f"{r['name']} {r['speedup_vs_eager']:.2f}x" for r in compiled
            if r.get("speedup_vs_eager") is not None))
    variants = [r for r in report["results"]
                if "+" in r["name"].removesuffix("+compile") and r.get("speedup_vs_plain")]
    if variants:
        lines.append("vs its fp32 eager twin: " + ", ".join(
            f"{r['name']} {r['speedup_vs_plain']:.2f}x" for r in variants))
    lines += _loop_lines(report["results"])
    torchrun = [r["name"] for r in report["results"]
                if r["status"] == "ok" and r["phase"] == "torchrun"]
    if torchrun:
        lines.append(f"{', '.join(torchrun)} were timed in a separate torchrun phase, "
                     "not interleaved with the others.")
    return "\n".join(lines)


def _noise_lines(results: list[dict]) -> list[str]:
    """The line under the table that names the rows marked ``!``, if any."""
    return noise_lines([(r["name"], r["step_time_s"]) for r in results if r["status"] == "ok"],
                       "their times and ratios say nothing. Rerun on an idle machine or with "
                       "more --steps.")


def _beyond_lines(results: list[dict]) -> list[str]:
    """The line under the table naming the speed-ups over single marked ``?``, if any."""
    claims = [f"{r['name']} {r['speedup_vs_single']:.2f}x on {len(r['devices'])} device(s)"
              for r in results if r["status"] == "ok" and beyond_linear(r)]
    if not claims:
        return []
    return [f"{IMPOSSIBLE} vs single beyond what the devices can give: {'; '.join(claims)}: "
            f"single's step (or this one's) was disturbed; rerun on an idle machine or with "
            f"more --steps"]


def split_lines(report: dict) -> list[str]:
    """With ``--handicap``: each uneven split's measured speed over its strategy's even split
    beside the most the handicap lets a split gain (:func:`~tandem.parallel.split.split_gain`,
    the slowest device setting the pace); one measured beyond it is marked ``?``."""
    c = report["config"]
    if not c.get("handicap"):
        return []
    index, factor = c["handicap"].split(":")
    per_sample = [float(factor) if i == int(index) else 1.0 for i in range(len(c["device_list"]))]
    best = split_gain(c["batch_size"], per_sample, [1 / t for t in per_sample])
    ok = {r["name"]: r for r in report["results"] if r["status"] == "ok"}
    measured, claims = [], []
    for name, r in ok.items():
        base = ok.get(name.split("/")[0])
        if "/" not in name or base is None or base is r:
            continue
        gain = base["step_time_s"]["median"] / r["step_time_s"]["median"]
        beyond = gain > BEYOND_LINEAR * best
        measured.append(f"{name} {gain:.2f}x{f' {IMPOSSIBLE}' if beyond else ''}")
        if beyond:
            claims.append(f"{name} {gain:.2f}x")
    if not measured:
        return []
    lines = [f"split vs even split of the same strategy: {', '.join(measured)}; under "
             f"--handicap {c['handicap']} a split gains {best:.2f}x at most (the slowest "
             f"device sets the pace)"]
    if claims:
        lines.append(f"{IMPOSSIBLE} beyond what the handicap allows: {'; '.join(claims)}: the "
                     f"even split's step (or this one's) was disturbed; rerun on an idle "
                     f"machine or with more --steps")
    return lines


def _loop_lines(results: list[dict]) -> list[str]:
    """``--loop``: each loop twin's median (IQR) next to its bench step's, and their ratio
    (``?`` below 1: a loop cannot be faster than its own step)."""
    by_twin = {r["name"] + LOOP: r["step_time_s"] for r in results if r["status"] == "ok"}
    twins = [r for r in results if r.get("loop_over_step") is not None]
    if not twins:
        return []
    lines = ["train loop step vs bench step (median ms, IQR; loop/step 1.00x: the loop costs "
             "nothing more):"]
    claims = []
    for r in twins:
        loop, step = r["step_time_s"], by_twin[r["name"]]  # its bench step's
        noise = " (noise)" if is_noise(loop) or is_noise(step) else ""
        if impossible(r["loop_over_step"]):
            noise += f" {IMPOSSIBLE}"
            claims.append(f"{r['name']} {r['loop_over_step']:.3f}x its own step")
        lines.append(f"  {r['name']}: {_ms(loop['median'])} ({_ms(loop['iqr'])}) vs "
                     f"{_ms(step['median'])} ({_ms(step['iqr'])}): "
                     f"{r['loop_over_step']:.3f}x{noise}")
    return lines + impossible_lines(claims)


def write_json(report: dict, path: str, stream: TextIO | None = None) -> None:
    """Write ``report`` as JSON to ``path`` (stdout for ``-``); other values as their ``str``."""
    text = json.dumps(report, indent=2, sort_keys=False, default=str)
    if path == "-":
        (stream or sys.stdout).write(text + "\n")
    else:
        with open(path, "w") as f:
            f.write(text + "\n")


def explain(model, devices, batch_size: int, image_size: int, split=None,
            per_sample=None) -> str:
    """tandem.hybrid's cost report (``plan(...).report()``) for ``model``, or why there is none;
    with ``split``/``per_sample`` (``--handicap``) it includes what that split costs, and says
    so for a model that has no hybrid plan too (:func:`tandem.parallel.split.split_report`)."""
    try:
        return plan(model, devices, batch_size=batch_size, input_size=image_size, split=split,
                    per_sample=per_sample, unit=None if per_sample is None else UNIT).report()
    except TandemError as exc:  # no head it can split
        line = (f"--explain: {type(model).__name__}: hybrid does not apply "
                f"({first_line(flagged(exc))})")
    if per_sample is None:
        return line
    sample = 3 * image_size * image_size * next(model.parameters()).element_size()
    return "\n".join([line, *split_report(batch_size, len(devices), split, per_sample,
                                            sample, unit=UNIT)])


def run_setup(devices, threads: int | None) -> str:
    """What ``--explain`` says of how the race runs its CPU replicas' backward (decided when
    each ``DataParallel`` is built, from the race's ``threads``) and of glibc's malloc."""
    threads = torch.get_num_threads() if threads is None else threads
    cpu = sum(torch.device(d).type == "cpu" for d in devices)
    if cpu < 2:
        line = "backward: autograd's own (fewer than 2 CPU replicas)"
    else:
        how = ("each replica's in its own thread" if threaded_backward.decide(
            devices, threads=threads) else "all in autograd's one thread")
        line = (f"backward: {', '.join(strategy_names(replica_threads=True))} on {cpu} CPU "
                f"replicas with {threads} "
                f"intra-op thread(s): {how} (with a split: in threads)")
    default = malloc_left_alone(Environment.read())
    return line + "\nmalloc: " + ("glibc's own (TANDEM_MALLOC=default)" if default else
                                  "glibc's thresholds fixed for this process (tandem.cpu_malloc)")


UNIT = " sample-times"  # one sample on a device without the handicap


def planned_vs_measured(report: dict, planned: dict[str, int]) -> str:
    """``--explain`` after the race: each strategy's bytes per step as the plan predicts them
    (:func:`tandem.strategies.auto.planned_bytes`; a multi-process one's, each process's:
    :func:`~tandem.strategies.auto.planned_process_bytes`) next to its measured step and
    counted bytes (and what the count misses), so a plan and a clock that disagree show."""
    lines = ["plan vs clock: strategy, planned bytes/step, counted bytes/step, step ms"]
    for r in report["results"]:
        if r["kind"] != "strategy" or r["status"] != "ok":
            continue
        traffic = r["bytes_per_step"] or {}
        line = (f"  {r['name']:<18}{format_bytes(planned.get(r['name'])):>10}"
                f"{format_bytes(traffic.get('total')):>12}{_ms(r['step_time_s']['median']):>10}")
        if traffic.get("uncounted"):
            line += f"  + {traffic['uncounted']} (not counted)"
        lines.append(line)
    if not planned:
        lines.append("  (no plan: the model has no Linear head tandem.hybrid can plan)")
    return "\n".join(lines)
