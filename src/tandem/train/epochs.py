"""The run around the epochs: train, validate, log and save after each, then stop.

:meth:`Trainer.fit <tandem.train.loop.Trainer.fit>` delegates here. The trainer owns one
epoch's steps and the checkpoint; this module owns what follows each epoch: the metrics row,
``curves.png``, TensorBoard, the summary line, and the stop a signal asks for.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace

from tandem.distributed.env import restarts_left, speaks_for_node
from tandem.distributed.resume_command import resume_command_here
from tandem.strategies.outputs import label_smoothing

from . import diverged
from .curves import plot_curves
from .interrupt import Interrupted, StopRequest
from .metrics import Meter, MetricsLog, peak_memory_mb, reset_peak_memory, score_fields, \
    summary_line
from .schedule import lr_factor
from .tensorboard import TensorBoard

__all__ = ["epoch_progress", "epoch_record", "fit", "interrupted_message", "plot",
           "CURVES_EVERY_S"]

#: ``curves.png`` is drawn again after a row at most this often (a draw costs about half a
#: second of CPU), and always when the run ends or stops, so short epochs do not pay a draw
#: each while a long run's figure is never more than one epoch or this many seconds behind
CURVES_EVERY_S = 30.0


def fit(trainer, log: MetricsLog | None, stop: StopRequest | None = None) -> list[dict]:
    """See :meth:`Trainer.fit <tandem.train.loop.Trainer.fit>`: ``trainer``'s epochs, with the
    rows of ``log`` (main process) and TensorBoard open around them; returns the rows."""
    trainer.stop = stop or trainer.stop
    s = trainer.strategy
    trainer.started_at = replace(trainer.position)
    records = log.read() if s.is_main else []
    board, figure = None, _Figure()
    if s.is_main and log is not None:
        if log.dropped:  # rows a resume dropped leave the figure at once
            figure.draw(trainer, records)
        board = TensorBoard.open(trainer.run_dir.tensorboard, records)
    try:
        _epochs(trainer, log, records, board, figure)
    except RuntimeError as exc:
        where = (f"in step {trainer.position.step + 1}" if trainer.in_flight is not None else
                 f"after step {trainer.position.step}")
        lost = s.lost_peer(exc, where)
        if lost is None:
            raise
        saved = trainer.save_at_failure()
        raise type(lost)(f"{lost}; {after_loss(trainer, saved)}", quiet=lost.quiet) from None
    finally:
        figure.catch_up(trainer, records)  # also when a signal or an error ends it
        if board is not None:
            board.close()
    return records


class _Figure:
    """When ``curves.png`` is drawn: after a row once :data:`CURVES_EVERY_S` have passed
    since the last draw, else at the run's end (:meth:`catch_up`)."""

    def __init__(self):
        self.drawn_at, self.behind = time.monotonic(), False

    def row_added(self, trainer, records: list[dict]) -> None:
        self.behind = True
        if time.monotonic() - self.drawn_at >= CURVES_EVERY_S:
            self.draw(trainer, records)

    def catch_up(self, trainer, records: list[dict]) -> None:
        if self.behind:
            self.draw(trainer, records)

    def draw(self, trainer, records: list[dict]) -> None:
        plot(trainer, records)
        self.drawn_at, self.behind = time.monotonic(), False


def _epochs(trainer, log: MetricsLog | None, records: list[dict],
            board: TensorBoard | None, figure: _Figure) -> None:
    """Epochs until ``epochs`` or ``max_steps``; then say where the best weights are."""
    cfg, pos = trainer.cfg, trainer.position
    max_steps = cfg.optim.max_steps
    trained = False
    while pos.epoch < cfg.optim.epochs and not (max_steps and pos.step >= max_steps):
        stopped = _epoch(trainer, log, records, board, figure)
        trained = True
        if stopped:
            break
    if trainer.strategy.is_main:
        print(_best_line(trainer) if trained else
              f"nothing to train: at epoch {pos.epoch}/{cfg.optim.epochs}, step {pos.step}"
              + (f"/{max_steps}" if max_steps else ""), flush=True)


def _best_line(trainer) -> str:
    """Where the best weights are; or, when no validation was finite (so none was "best"),
    that no best.pt was written and which file holds the weights instead."""
    run = trainer.run_dir
    if os.path.exists(run.best):
        return f"best val acc {trainer.best_acc1:.2f}%: {run.best}"
    return (f"no validation was finite (val loss nan or inf), so no {run.BEST} was written: "
            f"the last weights are in {run.latest} (tandem eval --resume {run.latest}; "
            f"--resume {run.path} continues the run)")


def _epoch(trainer, log: MetricsLog | None, records: list[dict],
           board: TensorBoard | None, figure: _Figure) -> bool:
    """Train one epoch (or to ``--max-steps``), validate, save, log; True when stopped part-way.
    A stop request saves and raises :class:`Interrupted` instead of validating."""
    s, pos, stop = trainer.strategy, trainer.position, trainer.stop
    reset_peak_memory(s.devices)
    train, stopped, seconds = trainer.train_epoch()
    train = train.reduced(s)
    diverged.check(trainer, train, weights=True)  # nothing non-finite is ever saved
    if stop.requested:
        with stop.critical():
            trainer.save(is_best=False, progress=epoch_progress(train, seconds,
                                                                trainer.lr_steps))
        message = interrupted_message(trainer)
        raise Interrupted(message, stop.signum, quiet=not message)
    # A non-finite val loss (fp16 logits past 65504 from early BatchNorm statistics)
    # is reported, not fatal: only train loss and weights stop a run (above).
    val = trainer.validate()
    if not stopped:
        pos.epoch, pos.batch = pos.epoch + 1, 0
    # The first validation of a run directory always writes best.pt (even at 0%),
    # unless its loss is not finite: such a model is never "best".
    is_best = val.finite and (val.acc > trainer.best_acc1
                              or not os.path.exists(trainer.run_dir.best))
    if val.finite:
        trainer.best_acc1 = max(trainer.best_acc1, val.acc)
    record = epoch_record(trainer, train, val, stopped, seconds)
    with stop.critical():
        trainer.save(is_best, progress=epoch_progress(train, seconds, trainer.lr_steps)
                     if stopped else None)
        if s.is_main and train.count:  # a row only for an epoch that trained
            _write_row(trainer, log, records, board, figure, record)
    return stopped


def epoch_record(trainer, train: Meter, val: Meter, stopped: bool, seconds: float) -> dict:
    """The metrics row of the epoch just trained (reduced ``train`` and ``val`` meters), read
    after the position moved on; ``partial`` when ``--max-steps`` stopped it part-way."""
    pos, s = trainer.position, trainer.strategy
    record = {
        "epoch": pos.epoch if not stopped else pos.epoch + 1,
        "step": pos.step,
        "batches": pos.batch if stopped else trainer.batches_per_epoch,
        "partial": stopped,  # --max-steps stopped it part-way: a resume redoes it
        "train_loss": train.loss, **score_fields("train", train),
        "val_loss": val.loss, "val_finite": val.finite, **score_fields("val", val),
        **({"val_plain_ce": val.ce} if label_smoothing(trainer.criterion) else {}),
        "lr": trainer.optimizer.param_groups[0]["lr"],
        "lr_steps": thinned(trainer.lr_steps),  # [step, lr] each step used (curves.png)
        "images_per_sec": train.count / seconds if seconds > 0 else None,
        "seconds": seconds,
        **trainer.wait.fields(),  # data_seconds, step_seconds, ... (.datawait)
        "peak_memory_mb": peak_memory_mb(s.devices),
    }
    if trainer.batch_shares() is not None:
        record["split"] = trainer.batch_shares()
    if trainer.train_from is not None:  # the sums before it were lost with a peer
        record["train_from_batch"], trainer.train_from = trainer.train_from, None
    return record


def _write_row(trainer, log: MetricsLog, records: list[dict], board: TensorBoard | None,
               figure: _Figure, record: dict) -> None:
    """The main process's outputs of one epoch: the metrics row, figure, board and line."""
    cfg = trainer.cfg
    records.append(record)
    log.append(record)
    figure.row_added(trainer, records)
    if board is not None:
        board.add_row(record)
    print(summary_line(record, cfg.optim.epochs, trainer.batches_per_epoch,
                       label_smoothing(trainer.criterion)), flush=True)
    trainer.wait.advise(cfg.data, trainer.strategy.device)  # once per run, when data waits


def plot(trainer, records: list[dict]) -> None:
    """``curves.png`` of ``records``, with the learning rate of every step (host-side)."""
    optim = trainer.cfg.optim
    per_epoch = -(-trainer.batches_per_epoch // optim.accum_steps)
    base = trainer.scheduler.base_lrs[0]
    plot_curves(records, trainer.run_dir.curves, schedule=(
        per_epoch, lambda t: base * lr_factor(t, optim, per_epoch)))


def interrupted_message(trainer) -> str:
    """Where the run stopped and how to continue it: the main process says it for the job,
    another machine's first process for its own node."""
    s, pos, out = trainer.strategy, trainer.position, trainer.cfg.run.out
    where = f"{trainer.run_dir.latest} at epoch {pos.epoch + 1}, step {pos.step}"
    if s.is_main:
        return f"saved {where}; continue with: {resume_command_here(out, s.multiprocess)}"
    if not speaks_for_node():
        return ""
    return (f"rank 0 saved {where} (on node 0); continue with: "
            f"{resume_command_here(out, True, this_node=True)}")


def after_loss(trainer, saved: str | None) -> str:
    """What a lost peer leaves: the checkpoint the main process saved, and how the run goes on
    (the launcher restarts it, or the command for each node)."""
    pos, out = trainer.position, trainer.cfg.run.out
    left = restarts_left()
    if saved is None:
        return ("rank 0 saves the last completed step" + ("; the launcher restarts the job" if
                left else f"; continue with: {resume_command_here(out, True, this_node=True)}"))
    done = f"saved {saved} at epoch {pos.epoch + 1}, step {pos.step}"
    if left:
        return f"{done}; the launcher restarts the job from it ({left} restart(s) left)"
    return f"{done}; continue with: {resume_command_here(out, True)}"


def epoch_progress(meter: Meter, seconds: float, lr_steps: list) -> dict:
    """A reduced meter, the seconds spent and the lr of each step so far, as a checkpoint's
    ``epoch_progress`` entry."""
    return {**meter.progress(), "seconds": seconds, "lr_steps": thinned(lr_steps)}


def thinned(points: list, most: int = 200) -> list:
    """At most ``most`` of ``points``, evenly spread, the first and the last kept: an epoch's
    lr curve, not every step of a long one."""
    if len(points) <= most:
        return [list(p) for p in points]
    every = (len(points) - 1) / (most - 1)
    return [list(points[round(i * every)]) for i in range(most)]
