"""A run directory, and what a fresh run, a resume and a restart may do to it: a fresh run
replaces one only with ``--overwrite``; ``--resume RUN`` keeps the stored settings but where
``on_resume`` (:mod:`tandem.config`) allows; an earlier checkpoint goes on only elsewhere.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

from tandem.config import FIXED, MAY_CHANGE, PER_CALL, SECTIONS, TrainConfig, flag_of
from tandem.data.load import GIVEN_DATA
from tandem.distributed.resume_command import resume_command
from tandem.errors import UsageError, param
from tandem.factory import is_reference, rebuildable
from tandem.keyed import TORCH
from tandem.strategies import strategy_class

from .metrics import MetricsLog
from .tensorboard import TensorBoard

#: what a run does to its directory: starts it, continues it there, continues it in a new one,
#: or writes nothing (validation only)
FRESH, RESUMED, FORKED, EVALUATE = "fresh", "resumed", "forked", "evaluate"


class RunDir:
    """The directory of one run: the only code that knows its files' names."""

    CONFIG, LATEST, BEST = "config.json", "checkpoint.pt", "best.pt"
    METRICS, CURVES, TENSORBOARD = "metrics.jsonl", "curves.png", "tb"
    LOCK = "run.lock"
    FILES = (LATEST, BEST, METRICS, CONFIG, CURVES)
    #: what the imagenet example's main.py writes in its working directory (not a run's file)
    EXAMPLE = "checkpoint.pth.tar"

    def __init__(self, path: str):
        self.path = path

    @classmethod
    def of(cls, checkpoint_file: str) -> "RunDir":
        """The run directory a checkpoint file lies in."""
        return cls(os.path.dirname(checkpoint_file) or ".")

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    latest = property(lambda self: self.file(self.LATEST))
    best = property(lambda self: self.file(self.BEST))
    metrics = property(lambda self: self.file(self.METRICS))
    curves = property(lambda self: self.file(self.CURVES))
    tensorboard = property(lambda self: self.file(self.TENSORBOARD))
    lock_file = property(lambda self: self.file(self.LOCK))

    def same(self, other: "RunDir") -> bool:
        return os.path.abspath(self.path) == os.path.abspath(other.path)

    def is_latest(self, path: str) -> bool:
        """True when ``path`` is this run's ``checkpoint.pt``."""
        return os.path.abspath(path) == os.path.abspath(self.latest)

    # -- reading ----------------------------------------------------------------------------
    def read_config(self) -> dict | None:
        """``config.json`` as written (``None`` when missing or unreadable)."""
        try:
            with open(self.file(self.CONFIG), encoding="utf-8") as f:
                saved = json.load(f)
        except (OSError, ValueError):
            return None
        return saved if isinstance(saved, dict) else None

    def read_metrics(self) -> list[dict]:
        """The rows of ``metrics.jsonl`` (none when it is missing or unreadable)."""
        try:
            return MetricsLog.read_rows(self.metrics)
        except (OSError, ValueError):
            return []

    def describe(self) -> str | None:
        """A few words on the run here (``None``: none, or a ``config.json`` alone)."""
        present = [name for name in self.FILES if os.path.exists(self.file(name))]
        if not present or present == [self.CONFIG]:
            return None
        rows = self.read_metrics()
        accs = [r["val_acc"] for r in rows if isinstance(r.get("val_acc"), (int, float))]
        if not accs:
            return "its " + ", ".join(present)
        return f"{rows[-1].get('epoch')} epoch(s), best val acc {max(accs):.2f}%"

    def check_fresh(self, overwrite: bool) -> None:
        """Refuse a fresh run here when one is here already, unless ``overwrite``."""
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise UsageError(f"--out '{self.path}' is an existing file, not a directory")
        what = self.describe()
        if what and not overwrite:
            raise UsageError(f"{param('out')} '{self.path}' already holds a run ({what})",
                             hint=f"continue it with {param('resume')} {self.path}, choose another "
                                  f"{param('out')}, or replace it with {param('overwrite')}")

    def check_writable(self) -> None:
        """Refuse, before any work, a run that could not write here."""
        where = self.path if os.path.isdir(self.path) else os.path.dirname(
            os.path.abspath(self.path))
        while not os.path.exists(where):  # the nearest parent that exists will hold it
            where = os.path.dirname(where)
        names = [n for n in (*self.FILES, self.TENSORBOARD) if os.path.exists(self.file(n))]
        for path in [where] + [self.file(n) for n in names]:
            if not os.access(path, os.W_OK):
                what = "file" if os.path.isfile(path) else "directory"
                raise UsageError(f"cannot write to run '{self.path}': {what} '{path}' is "
                                 f"read-only (make it writable, or give another --out)")

    def launched_by(self, launch: str | None) -> bool:
        """True when the run here was started by the launch ``launch`` (a torchrun restart)."""
        resolved = (self.read_config() or {}).get("resolved")
        return bool(launch) and isinstance(resolved, dict) and resolved.get("launch_id") == launch

    # -- writing (the main process only) ----------------------------------------------------
    def create(self) -> None:
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as exc:  # a parent is a file, no permission, ...
            raise UsageError(f"cannot create --out '{self.path}': {exc.strerror or exc}") from None

    def clear(self) -> None:
        """Remove an earlier run's files (``--overwrite``), its TensorBoard events too."""
        for name in self.FILES:
            if os.path.isfile(self.file(name)):
                os.remove(self.file(name))
        TensorBoard.clear(self.tensorboard)

    def fork_from(self, source: "RunDir") -> None:
        """Start with run ``source``'s history (``metrics.jsonl``, ``best.pt``)."""
        for name in (self.METRICS, self.BEST):
            if os.path.isfile(source.file(name)):
                shutil.copyfile(source.file(name), self.file(name))

    def write_config(self, resolved: dict) -> None:
        """Write ``config.json`` whole or not at all (temp file + rename)."""
        temp = self.file(f".{self.CONFIG}.tmp")
        with open(temp, "w", encoding="utf-8") as f:
            json.dump(resolved, f, indent=2)
        os.replace(temp, self.file(self.CONFIG))


def checkpoint_path(resume: str) -> str:
    """``RUN`` or ``RUN/checkpoint.pt`` -> the checkpoint file to resume from."""
    run = RunDir(resume)
    if os.path.isdir(resume) and os.path.isfile(run.latest):
        return run.latest
    if os.path.isdir(resume) and os.path.isfile(run.file(run.CONFIG)):
        raise UsageError(f"run '{resume}' has no checkpoint yet: it stopped before its first "
                         f"save", hint=f"start it again with the command that started it (a "
                                       f"fresh run may replace a run without a checkpoint; "
                                       f"its settings are in {run.file(run.CONFIG)})")
    return resume  # checkpoint.load names whatever is wrong with it


def example_file_note(path: str, data: str, evaluate: bool) -> str | None:
    """The line saying that the run of ``path`` also holds a newer file of the imagenet
    example's, and the command that uses it instead; ``None`` when there is none."""
    run = RunDir.of(path)
    newer = run.file(RunDir.EXAMPLE)
    try:
        if not run.is_latest(path) or os.path.getmtime(newer) <= os.path.getmtime(run.latest):
            return None
    except OSError:  # either is missing
        return None
    use = (f"tandem eval --resume {newer} --data {data}" if evaluate else
           f"tandem train --resume {newer} --data {data} --out NEWDIR")
    return (f"run '{run.path}' also holds {RunDir.EXAMPLE}, newer than its {RunDir.LATEST} "
            f"(the imagenet example's main.py continued the run there): this "
            f"{'evaluates' if evaluate else 'continues'} {RunDir.LATEST}; for the example's "
            f"file: `{use}`")


def target_of(path: str) -> str:
    """What to give ``--resume`` for ``path``: its run directory for its latest, else the file."""
    run = RunDir.of(path)
    return run.path if run.is_latest(path) else path


def command(saved: dict, target: str, extra: str = "") -> str:
    """The command that continues ``target`` as the run that saved ``saved`` ran, + ``extra``."""
    strategy = TrainConfig.from_dict(saved).parallel.strategy
    processes = int((saved.get("resolved") or {}).get("world_size") or 1)
    return resume_command(target, strategy_class(strategy).multiprocess, processes) + extra


def _show(value) -> str:
    return "(none)" if value is None else str(value)


def resume_config(cfg: TrainConfig, given: frozenset[str], saved: dict,
                  path: str, main: bool = True) -> tuple[TrainConfig, list[str]]:
    """The config to continue the run whose checkpoint at ``path`` holds ``saved`` (``main``:
    this process writes the run), and one line per accepted change."""
    run = TrainConfig.from_dict(saved)
    if "dropout_rng" not in (saved.get("model") or {}):  # saved before dropout was keyed:
        run = dataclasses.replace(  # it goes on drawing from torch's generator, as it did
            run, model=dataclasses.replace(run.model, dropout_rng=TORCH))
    sections, notes, refused = {}, [], []
    for name in SECTIONS:
        mine, theirs = getattr(cfg, name), getattr(run, name)
        values = {}
        for f in dataclasses.fields(mine):
            new, old = getattr(mine, f.name), getattr(theirs, f.name)
            policy = f.metadata.get("on_resume", FIXED)
            changed = f.name in given and new != old
            if policy == FIXED and changed and not cfg.run.evaluate and not stands_in(f.name, old):
                refused.append((f.name, new, old))
            values[f.name] = new if policy == PER_CALL or changed else old
            if policy == MAY_CHANGE and changed:
                notes.append(_change_note(flag_of(f)[-1], new, old))
            elif policy == FIXED and changed:  # what tandem.fit was handed, named here
                notes.append(f"{flag_of(f)[-1]} {new}: in place of what tandem.fit was handed")
        sections[name] = type(mine)(**values)
    if refused:
        _refuse_changes(refused, path)
    source = RunDir.of(path)
    out = cfg.run.out if "out" in given else source.path
    # -e (main.py's `-e --resume RUN/best.pt`) writes nothing; only the main process writes
    if not cfg.run.evaluate and main:
        _check_rollback(path, RunDir(out), saved)
    if not RunDir(out).same(source):
        notes.append(f"--out {out}: a new run directory, forked from '{source.path}'")
    sections["run"] = dataclasses.replace(sections["run"], out=out)
    return TrainConfig(**sections), notes


def _refuse_changes(refused: list[tuple], path: str) -> None:
    """Refuse, in one line, the settings typed that would change what the run computes."""
    def listed(values) -> str:
        items = [f"{param(name)} {_show(value)}" for name, value in values]
        return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"

    them = "it" if len(refused) == 1 else "them"
    raise UsageError(f"{listed((n, new) for n, new, _ in refused)} would change the run of "
                     f"'{path}', which has {listed((n, old) for n, _, old in refused)}",
                     hint=f"resume without {them}, or start a new run with another {param('out')}")


def stands_in(name: str, value) -> bool:
    """True when ``value`` of field ``name`` stands in for what ``tandem.fit`` was handed."""
    if name == "data":
        return value == GIVEN_DATA
    return name == "arch" and is_reference(value) and not rebuildable(value)


def handed_to_fit(cfg: TrainConfig) -> list[str]:
    """The fields of ``cfg`` (``arch``, ``data``) that :func:`stands_in`."""
    return [name for name, value in (("arch", cfg.model.arch), ("data", cfg.data.data))
            if stands_in(name, value)]


def _check_rollback(path: str, out: RunDir, saved: dict) -> None:
    """Refuse to continue an earlier checkpoint of a run (``best.pt``) in its own directory."""
    run = RunDir.of(path)
    if run.is_latest(path) or not os.path.isfile(run.latest) or not out.same(run):
        return
    name = os.path.basename(path)
    raise UsageError(f"--resume {path} would roll run '{run.path}' back to {name} and overwrite "
                     f"its latest {RunDir.LATEST}: continue the latest with "
                     f"`{command(saved, run.path)}`, or fork from {name} with "
                     f"`{command(saved, path, ' --out NEWDIR')}`")


def _change_note(flag: str, new, old) -> str:
    if flag == "--epochs":
        return f"--epochs {new}: the learning-rate schedule now spans {new} epochs (was {old})"
    return f"{flag} {_show(new)} (the run had {_show(old)})"
