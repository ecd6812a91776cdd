"""The training loop: :meth:`Trainer.fit` → an epoch → a step → the optimizer step, through
the strategy's interface only. A step never reads the device: losses are summed there and read
at ``--print-freq``, saves and an epoch's end. A lost peer: :func:`tandem.distributed.faults.ended`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
from torch import nn

from tandem import checkpoint
from tandem.config import MAY_CHANGE, OptimConfig, TrainConfig
from tandem.data import LoaderCache, batch_to_device
from tandem.data.loader import PREFETCH, rank_rows
from tandem.data.mixing import Mixing, Pairing
from tandem.distributed import faults, membership
from tandem.distributed.env import elastic_launch
from tandem.distributed.resume_command import resume_command_here
from tandem.errors import TrainingDiverged
from tandem.keyed import KEYED, step_stream
from tandem.optim import GradClip, ModelEma
from tandem.parallel.split import format_shares
from tandem.parallel.work_clock import synchronize
from tandem.precision import Precision
from tandem.strategies import Strategy
from tandem.strategies.outputs import label_smoothing

from .curves import plot_curves
from .datawait import DataWait
from .interrupt import Interrupted, StopRequest
from .metrics import (Meter, MetricsLog, not_validated, peak_memory_mb, reset_peak_memory,
                      score_fields, summary_line, validated)
from .progress import Progress
from .rundir import RunDir
from .schedule import epoch_state, example_optimizer_state, lr_factor
from .tensorboard import TensorBoard
from .writer import Writer, snapshot


#: seconds between two draws of ``curves.png`` (half a second of CPU each), and at the end
CURVES_EVERY_S = 30.0

#: minutes between checkpoints under several processes (``--save-minutes``): what a lost peer
#: can cost where no survivor can save
SAVE_MINUTES = 10.0

# torch warns so when GradScaler skipped the first step (inf gradients): expected here
_SKIPPED_FIRST = r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`"


@dataclass
class Position:
    """Where training stands in the data order."""

    epoch: int = 0  # epoch under way (0-based)
    batch: int = 0  # global batches of that epoch already trained on
    step: int = 0  # optimizer steps since the start of training


@dataclass
class EpochRun:
    """What the steps of one epoch share: running sums, progress, the clock."""

    meter: Meter
    progress: Progress
    carried_seconds: float = 0.0  # a resumed epoch's time before this invocation
    start: float = field(default_factory=time.perf_counter)
    look: bool = False  # the meter was read since the last look at the loss
    stopped: bool = False  # --max-steps ended the epoch part-way
    loss: torch.Tensor | None = None  # the last batch's mean loss, on the device

    def seconds(self) -> float:
        return self.carried_seconds + time.perf_counter() - self.start


@dataclass
class Trainer:
    """Everything a run needs, built by :mod:`tandem.train.build`; :meth:`fit` runs it."""

    cfg: TrainConfig
    strategy: Strategy
    model: nn.Module  # what the strategy's setup returned (maybe a wrapper)
    criterion: Callable
    optimizer: torch.optim.Optimizer | None  # None when the trainer only validates
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    scaler: torch.amp.GradScaler | None
    train_set: object
    val_set: object
    batches_per_epoch: int
    config_dict: dict  # the resolved config, stored in checkpoints
    position: Position = field(default_factory=Position)
    best_acc1: float = 0.0
    stop: StopRequest = field(default_factory=lambda: StopRequest(enabled=False))
    carried: dict | None = None  # a mid-epoch checkpoint's train sums (every process's)
    loaders: LoaderCache = field(default_factory=LoaderCache)  # persistent workers
    saved_step: int | None = None  # the step this run saved last (every rank)
    kept_at_start: int | None = None  # the step of the checkpoint --out held at the start
    started_at: Position = field(default_factory=Position)  # where this invocation began
    wait: DataWait = field(default_factory=DataWait)
    step_start: faults.StepStart | None = None  # where a lost peer's survivors undo a step
    train_from: int | None = None  # the batch the epoch's sums count from (after a lost peer)
    lr_steps: list = field(default_factory=list)  # [step, lr] of the epoch's steps
    writer: Writer = field(default_factory=Writer)  # rank 0's files, off the step's path
    stopping: bool = False  # the ranks agreed to stop at this step
    job_saved_step: int | None = None  # rank 0's last checkpoint on disk, as the vote said
    best_written: bool = False  # best.pt exists in --out
    last_save_at: float = field(default_factory=time.monotonic)  # the main process's clock
    launch_state: object = None  # what the node's launcher reads after an abort (or None)
    mixing: Mixing | None = None  # mixup and cutmix (None: off)
    clip: GradClip | None = None  # --clip-grad
    ema: ModelEma | None = None  # --model-ema
    precision: Precision | None = None  # what --amp is here, as the plan decided (None: fp32)

    # -- the run ----------------------------------------------------------------------------
    def fit(self, log: MetricsLog | None, stop: StopRequest | None = None) -> list[dict]:
        """Train until ``epochs`` or ``max_steps``; return the metrics rows (main process). A
        signal stops after a step, saved (:class:`~.interrupt.Interrupted`); a non-finite loss
        raises :class:`~tandem.errors.TrainingDiverged`."""
        self.stop = stop or self.stop
        s, pos, optim = self.strategy, self.position, self.cfg.optim
        self.started_at = replace(pos)
        self.best_written = s.is_main and os.path.exists(self.run_dir.best)
        self.job_saved_step = self.kept_at_start
        records = log.read() if s.is_main else []
        board, figure, trained = None, _Figure(), False
        if s.is_main and log is not None:
            if log.dropped:  # rows a resume dropped leave the figure at once
                figure.draw(self, records)
            board = TensorBoard.open(self.run_dir.tensorboard, records)
        try:
            while pos.epoch < optim.epochs and not (optim.max_steps
                                                    and pos.step >= optim.max_steps):
                trained = True
                if self._epoch(log, records, board, figure):
                    break
            if s.is_main:
                print(self._last_line(trained), flush=True)
        except RuntimeError as exc:  # a lost peer: what the run keeps, in one line
            ended = faults.ended(self, exc)
            if ended is None:
                raise
            self.completed()
            raise ended from None
        except BaseException:  # a signal or an error ends the run: its files first
            figure.catch_up(self, records)
            self.writer.flush()
            raise
        finally:
            figure.catch_up(self, records)
            if board is not None:
                board.close()
        return records  # the caller flushes the writer (after the ranks' last collective)

    def _last_line(self, trained: bool) -> str:
        """Where the best weights are, or why there is no best.pt and where the weights are."""
        run, pos, optim = self.run_dir, self.position, self.cfg.optim
        if not trained:
            return (f"nothing to train: at epoch {pos.epoch}/{optim.epochs}, step {pos.step}"
                    + (f"/{optim.max_steps}" if optim.max_steps else ""))
        if self.val_set is None:
            return (f"no validation data (val_data=None), so no {run.BEST}: the last weights "
                    f"are in {run.latest}")
        if self.best_written:
            judged = " (of the EMA weights, --model-ema)" if self.ema is not None else ""
            return f"best val acc{judged} {self.best_acc1:.2f}%: {run.best}"
        return (f"no validation was finite (val loss nan or inf), so no {run.BEST} was "
                f"written: the last weights are in {run.latest} (tandem eval --resume "
                f"{run.latest}; --resume {run.path} continues the run)")

    # -- one epoch --------------------------------------------------------------------------
    def _epoch(self, log: MetricsLog | None, records: list[dict],
               board: TensorBoard | None, figure: "_Figure") -> bool:
        """Train one epoch (or to ``--max-steps``), validate, save, log; True when stopped
        part-way. A stop saves and raises :class:`Interrupted`."""
        s, pos, stop = self.strategy, self.position, self.stop
        reset_peak_memory(s.devices)
        train, stopped, seconds = self.train_epoch()
        self.heard(s.agreement.settle())  # the vote of the epoch's last step
        # a signal since the vote
        self.stopping = self.stopping or s.agreement.any_of(stop.requested)
        train = train.reduced(s)
        self.check_finite(train, weights=True)  # nothing non-finite is ever saved
        if self.stopping:
            with stop.critical():
                self.save(is_best=False, progress=epoch_progress(train, seconds, self.lr_steps))
            self.completed()
            message = self.interrupted_message()
            raise Interrupted(message, stop.signum, quiet=not message)
        val, ema_val = self.validate(), None  # a non-finite val loss is reported, not fatal
        if self.ema is not None:
            with self.ema.swapped():
                ema_val = self.validate()
        if not stopped:
            pos.epoch, pos.batch = pos.epoch + 1, 0
        # the first finite validation always writes best.pt (even at 0%); the EMA's decides
        judged = val if ema_val is None else ema_val
        is_best = self.val_set is not None and judged.finite and (  # no validation: no best
            judged.acc > self.best_acc1 or not self.best_written)
        if judged.finite:
            self.best_acc1 = max(self.best_acc1, judged.acc)
        record = self.epoch_record(train, val, stopped, seconds, ema_val)
        with stop.critical():
            self.save(is_best, progress=epoch_progress(train, seconds, self.lr_steps)
                      if stopped else None)
            if s.is_main and train.count:  # a row only for an epoch that trained
                self._write_row(log, records, board, figure, record)
        return stopped

    def train_epoch(self) -> tuple[Meter, bool, float]:
        """Train to the end of the epoch or ``--max-steps``; return meter, stopped?, seconds."""
        run = self.begin_epoch()
        loader = self.loader(self.train_set, train=True, epoch=self.position.epoch,
                             start_batch=self.position.batch)
        try:
            for index, batch in enumerate(self.wait.timed(loader), start=self.position.batch):
                images, targets = self.device_batch(*batch)  # a mixed batch: mixed here
                if self.train_batch(run, index, images, targets) and self.after_step(run):
                    break
        finally:
            run.progress.close()
        synchronize(self.strategy.devices)  # the epoch's time ends with its queued GPU work
        return run.meter, run.stopped, run.seconds()

    def begin_epoch(self) -> EpochRun:
        """The epoch's meter (with carried sums), progress and clock; the model in training mode."""
        cfg, s, pos = self.cfg, self.strategy, self.position
        self.lr_steps = [list(p) for p in (self.carried or {}).get("lr_steps", [])]
        carried, self.carried = self.carried, None
        meter, carried_seconds = Meter(), 0.0
        if carried and faults.LOST_BEFORE in carried:  # saved at a lost peer: sums went with it
            self.train_from = int(carried[faults.LOST_BEFORE])
        elif carried and s.is_main:
            meter = Meter.from_sums(carried["loss_sum"], carried["correct"], carried["count"],
                                    carried.get("correct5", 0), carried.get("confusion"))
            carried_seconds = float(carried["seconds"])
        progress = Progress(self.batches_per_epoch, pos.batch,
                            f"epoch {pos.epoch + 1}/{cfg.optim.epochs}",
                            bar=s.is_main and not cfg.run.no_progress,
                            print_freq=cfg.run.print_freq if s.is_main else 0,
                            scope="rank 0 " if s.world_size > 1 else "", wait=self.wait,
                            mixed=self.mixing is not None)
        self.wait.start_epoch()
        self.model.train()
        return EpochRun(meter, progress, carried_seconds)

    # -- one step ---------------------------------------------------------------------------
    def train_batch(self, run: EpochRun, index: int, images: torch.Tensor,
                    targets: torch.Tensor) -> bool:
        """Global batch ``index`` (this process's share, on the device): forward and backward
        (under ``no_sync`` but for a step's last micro-batch); True when it stepped."""
        s, k, n = self.strategy, self.cfg.optim.accum_steps, self.batches_per_epoch
        print_freq = self.cfg.run.print_freq
        group_start = index - index % k
        group_size = min(k, n - group_start)  # the epoch's last step may be shorter
        last_micro = index == group_start + group_size - 1
        sync = contextlib.nullcontext() if last_micro else s.no_sync(self.model)
        if index == group_start:
            if s.compressor is not None and s.compressor.due(self.position):
                s.compressor.measure_next()  # the epoch's sampled step: its error, measured
            self.step_start = faults.StepStart.of(self)  # None where no survivor saves
            # freed here, not after the step: glibc would return it and the forward refault it
            self.optimizer.zero_grad(set_to_none=True)
        with sync:
            with self.autocast(), self.keyed_stream(index, index - group_start):
                out = s.forward_loss(self.model, self.criterion, images, targets,
                                     batch_size=self.global_batch(self.train_set, index))
            self.scaler.scale(out.loss / group_size).backward()
        run.meter.update(out.loss, out.correct, out.count, out.correct5, out.confusion, out.ce_sum)
        run.loss = out.loss.detach()
        due = print_freq > 0 and (index + 1) % print_freq == 0
        # a --print-freq line shows the job's sums (every rank reduces); a bar's refresh rank 0's
        shown = run.progress.update(out.count * s.world_size, run.meter.reduced(s)
                                    if due and s.world_size > 1 else run.meter)
        run.look |= (shown and s.world_size == 1) or due
        if not last_micro:
            return False
        pos = self.position
        self.lr_steps.append([pos.step, self.optimizer.param_groups[0]["lr"]])  # a host float
        if self.clip is not None:  # the true gradients (fp16: unscaled first), all reduced
            self.scaler.unscale_(self.optimizer)
            self.clip()
        optimizer_step(self.optimizer, self.scaler, self.scheduler)
        if self.ema is not None:
            self.ema.update()
        pos.batch, pos.step = index + 1, pos.step + 1
        self._rebalance(run.progress)
        if run.look:
            run.look = False
            self.check_finite(run.meter)
        return True

    def after_step(self, run: EpochRun) -> bool:
        """After an optimizer step: ``--max-steps``, the ranks' vote (a stop, a save due, rank
        0's step on disk) and ``--save-every``. True when the epoch ends here."""
        cfg, s, pos = self.cfg, self.strategy, self.position
        max_steps, save_every = cfg.optim.max_steps, cfg.run.save_every
        if max_steps is not None and pos.step >= max_steps:
            run.stopped = pos.batch < self.batches_per_epoch
            return True
        minutes = cfg.run.save_minutes
        if minutes is None:
            minutes = SAVE_MINUTES if s.multiprocess else 0.0
        save_due = (s.is_main and minutes > 0  # rank 0's clock votes; the ranks save together
                    and time.monotonic() - self.last_save_at >= 60.0 * minutes)
        verdict = s.agreement.vote(self.stop.requested, save_due, self.writer.written_step)
        self.heard(verdict)
        if self.stopping:  # every rank stops at this step
            return True
        due = verdict.save or (save_every and pos.step % save_every == 0)
        if due and pos.batch < self.batches_per_epoch:
            sums = run.meter.reduced(s)
            self.check_finite(sums, weights=True)
            self.save(is_best=False, progress=epoch_progress(sums, run.seconds(), self.lr_steps))
        return False

    def completed(self) -> None:
        """Tell the node's launcher the last completed step as the workers end (what a change
        of nodes costs: :mod:`tandem.distributed.membership`)."""
        if self.launch_state is not None:
            self.launch_state.update(completed=self.position.step)

    def heard(self, verdict) -> None:
        """Take what the ranks agreed (:class:`~tandem.distributed.agree.Verdict`)."""
        if verdict.stop:
            self.stop.requested = self.stopping = True
        if verdict.saved_step is not None and verdict.saved_step != self.job_saved_step:
            self.job_saved_step = verdict.saved_step
            if self.launch_state is not None:
                self.launch_state.saved(verdict.saved_step)

    def _rebalance(self, progress: Progress) -> None:
        """``--split auto``: let the strategy move the shares; say so when they moved."""
        s, pos = self.strategy, self.position
        if s.split.step(pos.epoch, pos.batch, self.cfg.data.workers * PREFETCH) and s.is_main:
            progress.shares = format_shares(self.batch_shares().values())
            progress.note(f"step {pos.step}: split {progress.shares} "
                          f"(samples per device of {self.cfg.optim.batch_size})")

    # -- what a step reads --------------------------------------------------------------------
    def loader(self, dataset, *, train: bool, epoch: int, start_batch: int = 0):
        s = self.strategy
        return self.loaders.get(dataset, self.cfg.optim.batch_size, shuffle=train,
                                seed=self.cfg.run.seed, epoch=epoch, workers=self.cfg.data.workers,
                                rank=s.rank, world_size=s.world_size, start_batch=start_batch,
                                pin_memory=s.device.type == "cuda",
                                split=s.split.loader_split() if train else None,
                                mix=self.mixing if train else None)

    def device_batch(self, images: torch.Tensor, targets: torch.Tensor,
                     pairing: Pairing | None = None):
        """Copy a batch to the device, normalising uint8 images there (the val set's
        normalisation serves both splits); ``pairing`` mixes a mixup/cutmix batch there."""
        device = self.strategy.device
        images = batch_to_device(images, device, channels_last=self.cfg.parallel.channels_last,
                                 normalization=getattr(self.val_set, "normalization", None))
        if images.is_floating_point():  # --dtype float64: after the float32 normalisation
            images = images.to(getattr(torch, self.cfg.parallel.dtype))
        targets = targets.to(device, non_blocking=True)
        return (images, targets) if pairing is None else pairing.mix(images, targets)

    def global_batch(self, dataset, index: int) -> int:
        """The size of global batch ``index`` of ``dataset`` (the last one short)."""
        batch = self.cfg.optim.batch_size
        if dataset is None:  # a bench twin steps one whole batch again and again
            return batch
        return max(0, min(batch, len(dataset) - index * batch))

    def autocast(self):
        return self.precision.autocast() if self.precision else contextlib.nullcontext()

    def keyed_stream(self, index: int, micro: int):
        """``--dropout-rng keyed`` (:mod:`tandem.keyed`): dropout's draws keyed by seed, step,
        micro-batch and this process's first row of global batch ``index``."""
        if self.cfg.model.dropout_rng != KEYED:
            return contextlib.nullcontext()
        s, pos = self.strategy, self.position
        samples = None if self.train_set is None else len(self.train_set)  # no set: a bench twin
        first, _ = rank_rows(samples, self.cfg.optim.batch_size, index, s.rank, s.world_size,
                             s.split.loader_split(), pos.epoch)
        return step_stream(self.cfg.run.seed, pos.step, micro, first)

    def batch_shares(self) -> dict | None:
        """Each device's (or rank's) samples of a whole batch under ``--split``, else None."""
        split = self.strategy.split
        if split.weights() is None:
            return None
        return {str(i): n for i, n in enumerate(split.sizes(self.cfg.optim.batch_size))}

    @torch.no_grad()
    def validate(self) -> Meter:
        """The meter over the whole validation set (empty without one)."""
        meter = Meter()
        if self.val_set is None:
            return meter
        self.model.eval()
        for index, (images, targets) in enumerate(self.loader(self.val_set, train=False, epoch=0)):
            images, targets = self.device_batch(images, targets)
            with self.autocast():
                out = self.strategy.forward_loss(self.model, self.criterion, images, targets,
                                                 batch_size=self.global_batch(self.val_set, index))
            meter.update(out.loss, out.correct, out.count, out.correct5, out.confusion, out.ce_sum)
        return meter.reduced(self.strategy)

    # -- a loss or weights no longer finite ---------------------------------------------------
    def check_finite(self, meter: Meter | None, *, weights: bool = False,
                     what: str = "train loss") -> None:
        """Raise :class:`TrainingDiverged` on every process when ``meter``'s loss (or with
        ``weights`` the model's weights) is not finite on any. Reads the device once."""
        s = self.strategy
        bad = meter is not None and not meter.finite
        if weights and not bad:
            bad, what = not weights_finite(self.model, s.device), "the weights"
        if not s.agreement.any_of(bad):
            return
        pos, cfg = self.position, self.cfg
        text = diverged_message(what, pos.epoch + 1, pos.step, cfg.optim.lr, cfg.run.out,
                                self.kept_step(), resume_command_here(cfg.run.out, s.agreement.env)
                                ) if s.is_main else ""
        raise TrainingDiverged(text, quiet=not s.is_main)

    def kept_step(self) -> int | None:
        """The step of the checkpoint in --out (``None``: none); the same on every rank."""
        return self.saved_step if self.saved_step is not None else self.kept_at_start

    # -- saving -----------------------------------------------------------------------------
    @property
    def run_dir(self) -> RunDir:
        return RunDir(self.cfg.run.out)

    def save(self, is_best: bool, progress: dict | None = None, rng: dict | None = None,
             alone: bool = False) -> None:
        """Write ``checkpoint.pt`` (and ``best.pt``) on the main process; every process calls
        it, but with ``alone`` (a peer lost: no collective). ``progress``: a mid-epoch save's
        sums; ``rng``: the RNG states (default: now's)."""
        s = self.strategy
        self.saved_step = self.position.step  # every rank: the ranks save together
        if progress is not None:
            progress = {**progress, "lr_steps": thinned(progress["lr_steps"])}
        # every rank's PowerSGD state, gathered (a collective unless alone)
        compressed = None if s.compressor is None else s.compressor.state(s.rank, alone)
        if not s.is_main and not s.state_needs_every_rank:
            return
        state = s.state_dict(self.model)  # a collective where the state needs every rank
        plain_optimizer = s.optimizer_state_dict(self.model, self.optimizer)
        ema = None if self.ema is None else self.ema.state_dict(lambda: s.state_dict(self.model))
        if not s.is_main:
            return
        pos = self.position
        extra = dict(
            epoch=pos.epoch,  # epochs completed, as in the imagenet example
            arch=self.cfg.model.arch, best_acc1=self.best_acc1,
            scheduler=epoch_state(self.optimizer, pos.epoch),  # what StepLR & co. can load
            tandem_scheduler=self.scheduler.state_dict(),  # tandem's own, per step
            scaler=self.scaler.state_dict(),
            rng=rng if rng is not None else checkpoint.capture_rng(self.strategy.device),
            data_position=dataclasses.asdict(pos), epoch_progress=progress,
            split=self.strategy.split.state_dict(), config=self.config_dict,
            members=membership.of(s.agreement),  # the machines that saved it
            **({} if ema is None else {"ema": ema}),  # plain layout, as state_dict
            **({} if compressed is None else {"grad_compression": compressed}),
        )
        # the lr the example's StepLR continues with, in the plain layout (any strategy loads it)
        optimizer = example_optimizer_state(self.optimizer, pos.epoch, plain_optimizer)
        state, optimizer, extra = snapshot((state, optimizer, extra))  # the writer's copy
        run, config = self.run_dir, extra["config"]

        def write_latest():
            checkpoint.save(run.latest, state, optimizer, **extra)
            run.write_config(config)  # the settings of the checkpoint just saved

        self.writer.write(run.latest, write_latest, step=pos.step)
        self.last_save_at = time.monotonic()
        if is_best:
            self.writer.write(run.best, lambda: checkpoint.save(run.best, state, optimizer,
                                                                **extra))
            self.best_written = True

    def interrupted_message(self) -> str:
        """Where the run stopped and how to continue it (rank 0; another node's first process)."""
        s, pos, out = self.strategy, self.position, self.cfg.run.out
        where = f"{self.run_dir.latest} at epoch {pos.epoch + 1}, step {pos.step}"
        env = s.agreement.env
        # under --nnodes MIN:MAX the launcher stops the workers for a node that joins or leaves
        # and goes on from this checkpoint; only a stop of the job itself needs the command
        changing = "; if the job's nodes changed, the launcher goes on from it; else" if (
            env is not None and elastic_launch(env.launch)) else ";"
        if s.is_main:
            return f"saved {where}{changing} continue with: {resume_command_here(out, env)}"
        if not env.speaks_for_node:
            return ""
        return (f"rank 0 saved {where} (on node 0){changing} continue with: "
                f"{resume_command_here(out, env, this_node=True)}")

    # -- the epoch's outputs ------------------------------------------------------------------
    def epoch_record(self, train: Meter, val: Meter, stopped: bool, seconds: float,
                     ema_val: Meter | None = None) -> dict:
        """The metrics row of the epoch just trained, read after the position moved on."""
        pos, s = self.position, self.strategy
        record = {
            "epoch": pos.epoch if not stopped else pos.epoch + 1, "step": pos.step,
            "batches": pos.batch if stopped else self.batches_per_epoch,
            "partial": stopped,  # --max-steps stopped it part-way: a resume redoes it
            "train_loss": train.loss, **score_fields("train", train),
            **({"train_targets": "mixed"} if self.mixing is not None else {}),
            **(validated(val, label_smoothing(self.criterion)) if self.val_set is not None
               else not_validated(val)),
            "lr": self.optimizer.param_groups[0]["lr"],
            "lr_steps": thinned(self.lr_steps),  # [step, lr] each step used (curves.png)
            "images_per_sec": train.count / seconds if seconds > 0 else None, "seconds": seconds,
            **self.wait.fields(),  # data_seconds, step_seconds, ... (.datawait)
            "peak_memory_mb": peak_memory_mb(s.devices),
        }
        if ema_val is not None:
            record.update(ema_val_loss=ema_val.loss, ema_val_finite=ema_val.finite,
                          **score_fields("ema_val", ema_val))
        if self.clip is not None:
            record.update(self.clip.fields())  # clipped_steps
        if s.compressor is not None:  # --grad-compression: the sampled step's relative error
            record["grad_error"] = s.compressor.take_error()
        if (shares := self.batch_shares()) is not None:
            record["split"] = shares
        if self.train_from is not None:  # the sums before it were lost with a peer
            record["train_from_batch"], self.train_from = self.train_from, None
        return record

    def _write_row(self, log: MetricsLog, records: list[dict], board: TensorBoard | None,
                   figure: "_Figure", record: dict) -> None:
        """The main process's outputs of one epoch: the metrics row, figure, board and line."""
        cfg = self.cfg
        records.append(record)
        # by the checkpoint's writer, after it: a row on disk means its epoch is saved
        self.writer.write(log.path, lambda: log.append(record), supersedes=False)
        figure.row_added(self, records)
        if board is not None:
            board.add_row(record)
        print(summary_line(record, cfg.optim.epochs, self.batches_per_epoch,
                           label_smoothing(self.criterion)), flush=True)
        advice = self.wait.advice(cfg.data.workers, self.strategy.device.type,
                                  hasattr(cfg.data, "decode"))  # once per run, when data waits
        if advice:
            print(advice, flush=True)


def optimizer_step(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                   scheduler: torch.optim.lr_scheduler.LRScheduler | None) -> None:
    """One optimizer step through ``scaler``, then one schedule step. A step GradScaler skips
    still counts (as in the imagenet example), so torch's warning about it is not shown."""
    scaler.step(optimizer)
    scaler.update()
    if scheduler is None:
        return
    if not scaler.is_enabled():
        scheduler.step()
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SKIPPED_FIRST, category=UserWarning)
        scheduler.step()


class _Figure:
    """Draws ``curves.png`` after a row at most every :data:`CURVES_EVERY_S`, and at the end."""

    def __init__(self):
        self.drawn_at, self.behind = time.monotonic(), False

    def row_added(self, trainer: Trainer, records: list[dict]) -> None:
        self.behind = True
        if time.monotonic() - self.drawn_at >= CURVES_EVERY_S:
            self.draw(trainer, records)

    def catch_up(self, trainer: Trainer, records: list[dict]) -> None:
        if self.behind:
            self.draw(trainer, records)

    def draw(self, trainer: Trainer, records: list[dict]) -> None:
        """``curves.png`` of ``records`` with every step's lr, drawn by the writer's thread."""
        optim = trainer.cfg.optim
        per_epoch = -(-trainer.batches_per_epoch // optim.accum_steps)
        base, path, rows = trainer.scheduler.base_lrs[0], trainer.run_dir.curves, list(records)
        classes = trainer.cfg.data.num_classes
        trainer.writer.write(path, lambda: plot_curves(rows, path, schedule=(
            per_epoch, lambda t: base * lr_factor(t, optim, per_epoch)), classes=classes))
        self.drawn_at, self.behind = time.monotonic(), False


def epoch_progress(meter: Meter, seconds: float, lr_steps: list) -> dict:
    """A checkpoint's ``epoch_progress`` entry: a reduced meter's sums, seconds, lrs."""
    return {**meter.progress(), "seconds": seconds, "lr_steps": lr_steps}


def thinned(points: list, most: int = 200) -> list:
    """At most ``most`` of ``points``, evenly spread, the first and the last kept."""
    if len(points) <= most:
        return [list(p) for p in points]
    every = (len(points) - 1) / (most - 1)
    return [list(points[round(i * every)]) for i in range(most)]


def weights_finite(model: nn.Module, device: torch.device) -> bool:
    """True when every floating-point parameter and buffer of ``model`` is finite (one sync)."""
    flags = [torch.isfinite(t).all().to(device)
             for t in itertools.chain(model.parameters(), model.buffers()) if t.is_floating_point()]
    return bool(torch.stack(flags).all()) if flags else True


def lr_may_change() -> bool:
    """Whether ``--resume RUN --lr X`` is accepted (``on_resume`` of the ``lr`` field)."""
    lr = next(f for f in dataclasses.fields(OptimConfig) if f.name == "lr")
    return lr.metadata.get("on_resume") == MAY_CHANGE


def diverged_message(what: str, epoch: int, step: int, lr: float, out: str,
                     kept_step: int | None, resume_command: str) -> str:
    """One line: what became non-finite and where, what was kept (``kept_step``), how to go on."""
    lower = f"{lr / 10:g}"
    head = f"{what} became non-finite by epoch {epoch}, step {step} (--lr {lr:g}); stopped"
    if kept_step is None:
        return (f"{head} before any checkpoint was saved; start the run again with a lower "
                f"--lr (e.g. --lr {lower}) and --overwrite")
    run = RunDir(out)
    kept = f"{head}, keeping {run.latest} from step {kept_step} (finite weights)"
    if lr_may_change():
        return f"{kept}; go on from it with a lower --lr: {resume_command} --lr {lower}"
    return (f"{kept}; --resume keeps a run's --lr, so to go on from those weights with a lower "
            f"one start a new run with --pretrained {run.latest} --lr {lower} --out NEW_DIR and "
            f"the run's other flags (in {run.file(run.CONFIG)})")
