"""A run directory is the unit of work: what a fresh run, a resume and a restart may do to it.

A fresh run replaces one in ``--out`` only with ``--overwrite``. ``--resume RUN`` keeps the
stored settings; flags may change only where and how long it goes on (``on_resume`` in
:mod:`tandem.config`); an earlier checkpoint of it (``best.pt``) goes on only in another
directory. A torchrun restart resumes its own launch's run (``TANDEM_LAUNCH_ID``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

from tandem.config import FIXED, MAY_CHANGE, PER_CALL, SECTIONS, TrainConfig, flag_of
from tandem.distributed.env import LAUNCH_ID_VAR, restart_count
from tandem.errors import UsageError
from tandem.strategies import strategy_class

__all__ = ["RUN_FILES", "checkpoint_path", "target_of", "command", "describe", "check_fresh",
           "clear", "resume_config", "restarted_run", "read_metrics", "fork"]

RUN_FILES = ("checkpoint.pt", "best.pt", "metrics.jsonl", "config.json", "curves.png")


def checkpoint_path(resume: str) -> str:
    """``RUN`` or ``RUN/checkpoint.pt`` -> the checkpoint file to resume from."""
    if os.path.isdir(resume) and os.path.isfile(os.path.join(resume, "checkpoint.pt")):
        return os.path.join(resume, "checkpoint.pt")
    return resume  # checkpoint.load names whatever is wrong with it


def run_dir_of(path: str) -> str:
    return os.path.dirname(path) or "."


def target_of(path: str) -> str:
    """What to give ``--resume`` for the checkpoint at ``path``: its run directory when it is
    the run's latest (``checkpoint.pt``), else the file."""
    return run_dir_of(path) if os.path.basename(path) == "checkpoint.pt" else path


def command(saved: dict, target: str, extra: str = "") -> str:
    """The command that continues ``target`` as the run that saved ``saved`` ran (its
    strategy, its number of processes), then ``extra``: what a message tells the user."""
    strategy = TrainConfig.from_dict(saved).parallel.strategy
    processes = int((saved.get("resolved") or {}).get("world_size") or 1)
    return strategy_class(strategy).resume_command_for(target, processes) + extra


def read_metrics(out: str) -> list[dict]:
    """The rows of ``out/metrics.jsonl`` (none when it is missing or unreadable)."""
    try:
        with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return []


def describe(out: str) -> str | None:
    """A few words on the run in ``out`` (``None`` when it holds none)."""
    present = [name for name in RUN_FILES if os.path.exists(os.path.join(out, name))]
    if not present:
        return None
    rows = read_metrics(out)
    accs = [r["val_acc"] for r in rows if isinstance(r.get("val_acc"), (int, float))]
    if not accs:
        return "its " + ", ".join(present)
    return f"{rows[-1].get('epoch')} epoch(s), best val acc {max(accs):.2f}%"


def check_fresh(out: str, overwrite: bool) -> None:
    """Refuse a fresh run into a directory that holds a run, unless ``overwrite``."""
    what = describe(out)
    if what and not overwrite:
        raise UsageError(f"--out '{out}' already holds a run ({what}); continue it with "
                         f"--resume {out}, choose another --out, or replace it with --overwrite")


def clear(out: str) -> None:
    """Remove an earlier run's files from ``out`` (``--overwrite``)."""
    for name in RUN_FILES:
        path = os.path.join(out, name)
        if os.path.isfile(path):
            os.remove(path)


def _show(value) -> str:
    return "(none)" if value is None else str(value)


def resume_config(cfg: TrainConfig, given: frozenset[str], saved: dict | None,
                  path: str) -> tuple[TrainConfig, list[str]]:
    """The config to continue the run whose checkpoint at ``path`` holds ``saved``.

    Returns it and one line per accepted change. Without ``saved`` (a foreign checkpoint) the
    command line rules and only ``arch`` comes from the file.
    """
    if not isinstance(saved, dict):
        return cfg, []
    run = TrainConfig.from_dict(saved)
    sections, notes = {}, []
    for name in SECTIONS:
        mine, theirs = getattr(cfg, name), getattr(run, name)
        values = {}
        for f in dataclasses.fields(mine):
            new, old = getattr(mine, f.name), getattr(theirs, f.name)
            policy = f.metadata.get("on_resume", FIXED)
            changed = f.name in given and new != old
            flag = flag_of(f)[-1]
            if policy == FIXED and changed:
                raise UsageError(
                    f"{flag} {_show(new)} would change the run of '{path}', which has "
                    f"{flag} {_show(old)}: resume without {flag}, or start a new run with "
                    f"another --out")
            values[f.name] = new if policy == PER_CALL or changed else old
            if policy == MAY_CHANGE and changed:
                notes.append(_change_note(flag, new, old))
        sections[name] = type(mine)(**values)
    out = cfg.run.out if "out" in given else run_dir_of(path)
    _check_rollback(path, out, saved)
    if os.path.abspath(out) != os.path.abspath(run_dir_of(path)):
        notes.append(f"--out {out}: a new run directory, forked from '{run_dir_of(path)}'")
    sections["run"] = dataclasses.replace(sections["run"], out=out)
    return TrainConfig(**sections), notes


def _check_rollback(path: str, out: str, saved: dict) -> None:
    """Refuse to continue an earlier checkpoint of a run (``best.pt``) in that run's directory:
    it would roll the run back and overwrite its latest ``checkpoint.pt``."""
    run = run_dir_of(path)
    latest = os.path.join(run, "checkpoint.pt")
    same = os.path.abspath(path) == os.path.abspath(latest)
    if same or not os.path.isfile(latest) or os.path.abspath(out) != os.path.abspath(run):
        return
    name = os.path.basename(path)
    raise UsageError(f"--resume {path} would roll run '{run}' back to {name} and overwrite its "
                     f"latest checkpoint.pt: continue the latest with "
                     f"`{command(saved, run)}`, or fork from {name} with "
                     f"`{command(saved, path, ' --out NEWDIR')}`")


def _change_note(flag: str, new, old) -> str:
    if flag == "--epochs":
        return f"--epochs {new}: the learning-rate schedule now spans {new} epochs (was {old})"
    return f"{flag} {_show(new)} (the run had {_show(old)})"


def restarted_run(out: str, environ=None) -> bool:
    """True in a worker that torchrun restarted when ``out`` holds this launch's own run."""
    environ = os.environ if environ is None else environ
    launch = environ.get(LAUNCH_ID_VAR)
    if restart_count(environ) < 1 or not launch:
        return False
    try:
        with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
            resolved = json.load(f).get("resolved") or {}
    except (OSError, ValueError, AttributeError):
        return False
    return resolved.get("launch_id") == launch


def fork(source: str, out: str) -> None:
    """Start ``out`` with run ``source``'s history (``metrics.jsonl``, ``best.pt``); the
    metrics log then keeps the rows up to the resumed checkpoint (``MetricsLog``)."""
    for name in ("metrics.jsonl", "best.pt"):
        if os.path.isfile(os.path.join(source, name)):
            shutil.copyfile(os.path.join(source, name), os.path.join(out, name))
