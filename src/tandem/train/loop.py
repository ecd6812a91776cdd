"""The training loop. It knows strategies only through their interface (no strategy names).

One optimizer step consumes ``accum_steps`` global batches (all but the last under
``strategy.no_sync``). Each process loads its share of every batch in an order set by
``(seed, epoch)`` only. The main process alone logs and writes checkpoints, which record
``data_position`` so ``--resume`` restarts at the very next batch with the same RNG state.
A step never reads the device: losses are summed there (:class:`Meter`) and read when printed,
saved or at the end of an epoch, where a non-finite one stops the run (:mod:`.diverged`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from tandem import checkpoint
from tandem.config import TrainConfig
from tandem.data import LoaderCache, batch_to_device
from tandem.data.loader import PREFETCH
from tandem.parallel.split import format_shares
from tandem.parallel.work_clock import synchronize
from tandem.distributed.env import cpu_bf16_override
from tandem.precision import amp_precision
from tandem.strategies import Strategy

from . import diverged, epochs
from .datawait import DataWait
from .epochs import epoch_progress, thinned
from .interrupt import StopRequest
from .metrics import Meter, MetricsLog
from .optimizer_step import optimizer_step
from .position import EpochRun, Position, StepStart
from .progress import Progress
from .rundir import RunDir
from .schedule import epoch_state, example_optimizer_state

__all__ = ["EpochRun", "Position", "Trainer", "optimizer_step", "LOST_BEFORE"]

#: the ``epoch_progress`` of a checkpoint saved at a lost peer: the batch its sums were lost at
LOST_BEFORE = "sums_lost_before_batch"


@dataclass
class Trainer:
    """Everything a run needs, built by :mod:`tandem.train.run`; :meth:`fit` runs it."""

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
    # The epoch under way's train sums (loss_sum, correct, count, seconds) over every process,
    # saved with a mid-epoch checkpoint so that the resumed epoch still gets one whole row.
    carried: dict | None = None
    loaders: LoaderCache = field(default_factory=LoaderCache)  # persistent workers
    # The step of the checkpoint.pt this run saved last (see diverged.kept_step).
    saved_step: int | None = None
    started_at: Position = field(default_factory=Position)  # where this invocation began
    wait: DataWait = field(default_factory=DataWait)  # the epoch's data wait (.datawait)
    # the optimizer step under way, as it began (several processes only: a lost peer can cut
    # it short, and the run is then saved as it was before it; see save_at_failure)
    in_flight: StepStart | None = None
    # the batch this epoch's train sums count from, when those before it were lost with a peer
    train_from: int | None = None
    # [step, lr] of each optimizer step of the epoch under way (a resumed one's earlier steps
    # too, carried in its checkpoint): the lr each step used, for its row and curves.png
    lr_steps: list = field(default_factory=list)

    # -- helpers ----------------------------------------------------------------------------
    def loader(self, dataset, *, train: bool, epoch: int, start_batch: int = 0):
        s = self.strategy
        return self.loaders.get(dataset, self.cfg.optim.batch_size, shuffle=train,
                                seed=self.cfg.run.seed, epoch=epoch,
                                workers=self.cfg.data.workers, rank=s.rank,
                                world_size=s.world_size, start_batch=start_batch,
                                pin_memory=s.device.type == "cuda",
                                split=s.split.loader_split() if train else None)

    def device_batch(self, images: torch.Tensor, targets: torch.Tensor):
        """Copy a batch to the device; uint8 images are normalised there (train and val
        splits share their normalisation, so the val set's serves both)."""
        device = self.strategy.device
        images = batch_to_device(images, device, channels_last=self.cfg.parallel.channels_last,
                                 normalization=getattr(self.val_set, "normalization", None))
        if images.is_floating_point():  # --dtype float64: after the float32 normalisation
            images = images.to(getattr(torch, self.cfg.parallel.dtype))
        return images, targets.to(device, non_blocking=True)

    def autocast(self):
        p = self.cfg.parallel
        return amp_precision(self.strategy.device.type, p.amp, p.amp_dtype,
                             cpu_bf16=cpu_bf16_override()).autocast()

    @property
    def run_dir(self) -> RunDir:
        return RunDir(self.cfg.run.out)

    # -- one epoch --------------------------------------------------------------------------
    def train_epoch(self) -> tuple[Meter, bool, float]:
        """Train to the end of the epoch or ``--max-steps``; return meter, stopped?, seconds."""
        run = self.begin_epoch()
        loader = self.loader(self.train_set, train=True, epoch=self.position.epoch,
                             start_batch=self.position.batch)
        try:
            for index, (images, targets) in enumerate(self.wait.timed(loader),
                                                      start=self.position.batch):
                images, targets = self.device_batch(images, targets)
                if self.train_batch(run, index, images, targets) and self.after_step(run):
                    break
        finally:
            run.progress.close()
        # the epoch's time (images_per_sec) ends when its queued GPU work does, not when the
        # host has queued it
        synchronize(self.strategy.devices)
        return run.meter, run.stopped, run.seconds()

    def begin_epoch(self) -> "EpochRun":
        """The epoch's meter (with carried sums), progress and clock; the model in training
        mode. Data comes after: :meth:`train_batch` takes device batches (and frees the last
        step's gradients before each step's first one)."""
        cfg, s, pos = self.cfg, self.strategy, self.position
        self.lr_steps = [list(p) for p in (self.carried or {}).get("lr_steps", [])]
        meter, carried_seconds = self._carried_meter()
        print_freq = cfg.run.print_freq
        progress = Progress(self.batches_per_epoch, pos.batch,
                            f"epoch {pos.epoch + 1}/{cfg.optim.epochs}",
                            bar=s.is_main and not cfg.run.no_progress,
                            print_freq=print_freq if s.is_main else 0,
                            scope="rank 0 " if s.world_size > 1 else "", wait=self.wait)
        self.wait.start_epoch()
        self.model.train()
        return EpochRun(meter, progress, carried_seconds)

    def train_batch(self, run: "EpochRun", index: int, images: torch.Tensor,
                    targets: torch.Tensor) -> bool:
        """Global batch ``index`` of the epoch (this process's share, on the device): forward,
        loss and backward (under ``no_sync`` but for a step's last micro-batch), the meter and
        progress; after the last micro-batch the optimizer step. True when it stepped."""
        s, k, n = self.strategy, self.cfg.optim.accum_steps, self.batches_per_epoch
        print_freq = self.cfg.run.print_freq
        group_start = index - index % k
        group_size = min(k, n - group_start)  # the epoch's last step may be shorter
        last_micro = index == group_start + group_size - 1
        sync = contextlib.nullcontext() if last_micro else s.no_sync(self.model)
        if index == group_start:
            if s.multiprocess:
                self.in_flight = StepStart.capture(self.model, s.device)
            # free the last step's gradients here, just before the forward allocates: freed
            # after the step instead, glibc gave the memory back to the system and this
            # forward faulted it in again (about 6% of a CPU step, BENCHMARKS.md section 11)
            self.optimizer.zero_grad(set_to_none=True)
        with sync:
            with self.autocast():
                out = s.forward_loss(self.model, self.criterion, images, targets)
            self.scaler.scale(out.loss / group_size).backward()
        # no host sync: the sums stay on the device
        run.meter.update(out.loss, out.correct, out.count, out.correct5, out.confusion,
                         out.ce_sum)
        run.loss = out.loss.detach()
        due = print_freq > 0 and (index + 1) % print_freq == 0
        # a --print-freq line shows the whole job's sums: every process reduces at the same
        # batch (the line reads the device anyway); a bar's timed refresh shows rank 0's
        shown = run.progress.update(out.count * s.world_size, run.meter.reduced(s)
                                    if due and s.world_size > 1 else run.meter)
        # Every process reads at --print-freq batches; a bar's refresh only the main one.
        run.look |= (shown and s.world_size == 1) or due
        if not last_micro:
            return False
        pos = self.position
        self.lr_steps.append([pos.step, self.optimizer.param_groups[0]["lr"]])  # a host float
        optimizer_step(self.optimizer, self.scaler, self.scheduler)
        pos.batch, pos.step = index + 1, pos.step + 1
        self.in_flight = None
        s.step_done(pos.step)
        self._rebalance(run.progress)
        if run.look:
            run.look = False
            self._check_finite(run.meter)
        return True

    def after_step(self, run: "EpochRun") -> bool:
        """After an optimizer step: ``--max-steps``, the stop vote (every process, every step)
        and ``--save-every``. True when the epoch ends here (``run.stopped``: part-way)."""
        cfg, s, pos = self.cfg, self.strategy, self.position
        max_steps, save_every = cfg.optim.max_steps, cfg.run.save_every
        if max_steps is not None and pos.step >= max_steps:
            run.stopped = pos.batch < self.batches_per_epoch
            return True
        if s.stop_vote(self.stop.requested):  # every rank stops at this step
            self.stop.requested = True
            return True
        if save_every and pos.step % save_every == 0 and pos.batch < self.batches_per_epoch:
            sums = run.meter.reduced(s)
            self._check_finite(sums, weights=True)
            self.save(is_best=False, progress=epoch_progress(sums, run.seconds(), self.lr_steps))
        return False

    def batch_shares(self) -> dict | None:
        """Each device's (or rank's) samples of a whole batch under ``--split``, else None."""
        split = self.strategy.split
        if split.weights() is None:
            return None
        sizes = split.sizes(self.cfg.optim.batch_size)
        return {str(i): n for i, n in enumerate(sizes)}

    def _rebalance(self, progress: Progress) -> None:
        """``--split auto``: let the strategy move the shares; say so when they moved."""
        s, pos = self.strategy, self.position
        ahead = self.cfg.data.workers * PREFETCH  # batches the loader has drawn already
        if s.split.step(pos.epoch, pos.batch, ahead) and s.is_main:
            progress.shares = format_shares(self.batch_shares().values())
            progress.note(f"step {pos.step}: split {progress.shares} "
                          f"(samples per device of {self.cfg.optim.batch_size})")

    def _carried_meter(self) -> tuple[Meter, float]:
        """A meter holding the carried sums of this epoch (on the main process only)."""
        carried, self.carried = self.carried, None
        if carried and LOST_BEFORE in carried:  # saved at a lost peer: the sums went with it
            self.train_from = int(carried[LOST_BEFORE])
            return Meter(), 0.0
        if not carried or not self.strategy.is_main:
            return Meter(), 0.0
        return Meter.from_sums(carried["loss_sum"], carried["correct"], carried["count"],
                               carried.get("correct5", 0), carried.get("confusion")), \
            float(carried["seconds"])

    def _check_finite(self, meter: Meter | None, *, weights: bool = False,
                      what: str = "train loss") -> None:
        """See :func:`.diverged.check` (raises :class:`TrainingDiverged` on every process)."""
        diverged.check(self, meter, weights=weights, what=what)

    @torch.no_grad()
    def validate(self) -> Meter:
        """Loss, top-1 and top-5 (pixel accuracy and mean IoU for dense outputs) over the whole
        validation set, every sample counted once (none without one: ``tandem.fit(...,
        val_data=None)``). Under autocast torch runs cross-entropy in float32 and the meter
        sums in float64, so only logits that overflowed in the model (fp16 past 65504) make
        the loss non-finite; :mod:`.epochs` reports that instead of stopping."""
        meter = Meter()
        if self.val_set is None:
            return meter
        self.model.eval()
        for images, targets in self.loader(self.val_set, train=False, epoch=0):
            images, targets = self.device_batch(images, targets)
            with self.autocast():
                out = self.strategy.forward_loss(self.model, self.criterion, images, targets)
            meter.update(out.loss, out.correct, out.count, out.correct5, out.confusion,
                         out.ce_sum)
        return meter.reduced(self.strategy)

    # -- saving -----------------------------------------------------------------------------
    def save_at_failure(self) -> str | None:
        """After a lost peer: undo the step it cut short (:class:`StepStart`) and save the last
        completed step, with no collective (the peers are gone); the path, on the main process.
        The epoch under way's train sums are not saved (they need the other processes): the
        resumed epoch's row counts the batches after the resume, and says from which
        (``train_from_batch``)."""
        start, self.in_flight = self.in_flight, None
        if start is not None:
            start.restore_buffers(self.model)
        if not self.strategy.is_main:
            return None
        self.save(is_best=False, progress={LOST_BEFORE: self.position.batch,
                                           "lr_steps": thinned(self.lr_steps)},
                  rng=start.rng if start is not None else None)
        return self.run_dir.latest

    def save(self, is_best: bool, progress: dict | None = None, rng: dict | None = None) -> None:
        """Write ``checkpoint.pt`` (and ``best.pt``) atomically, on the main process only.

        ``progress`` is the epoch under way's train sums when saving mid-epoch; ``rng`` the
        RNG states to save (default: as they are now).
        """
        if not self.strategy.is_main:
            return
        pos = self.position
        extra = dict(
            epoch=pos.epoch,  # epochs completed, as in the imagenet example
            arch=self.cfg.model.arch,
            best_acc1=self.best_acc1,
            scheduler=epoch_state(self.optimizer, pos.epoch),  # what StepLR & co. can load
            tandem_scheduler=self.scheduler.state_dict(),  # tandem's own, per step
            scaler=self.scaler.state_dict(),
            rng=rng if rng is not None else checkpoint.capture_rng(self.strategy.device),
            data_position=pos.as_dict(),
            epoch_progress=progress,
            split=self.strategy.split.state_dict(),
            config=self.config_dict,
        )
        state = self.strategy.state_dict(self.model)  # plain keys, split layers merged
        # the lr the example's StepLR continues with; tandem's own is in tandem_scheduler
        optimizer = example_optimizer_state(  # in the plain layout: any strategy loads it
            self.optimizer, pos.epoch, self.strategy.optimizer_state_dict(self.model,
                                                                          self.optimizer))
        checkpoint.save(self.run_dir.latest, state, optimizer, **extra)
        self.run_dir.write_config(self.config_dict)  # the settings of the checkpoint just saved
        self.saved_step = pos.step
        if is_best:
            checkpoint.save(self.run_dir.best, state, optimizer, **extra)

    # -- the run ----------------------------------------------------------------------------
    def fit(self, log: MetricsLog | None, stop: StopRequest | None = None) -> list[dict]:
        """Train until ``epochs`` or ``max_steps``; validate, log and save after each epoch
        (:func:`.epochs.fit`); return the metrics rows.

        A signal on any process (``stop``) stops every process after the current optimizer
        step, saves ``checkpoint.pt`` there and raises :class:`~.interrupt.Interrupted`. A
        non-finite loss or weights raise :class:`~tandem.errors.TrainingDiverged` and save
        nothing.
        """
        return epochs.fit(self, log, stop)
