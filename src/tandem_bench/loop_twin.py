"""``--loop``: the ``<name>/loop`` twin of a strategy contestant times ``tandem train``'s own step.

The twin builds a real :class:`~tandem.train.loop.Trainer` around the same strategy, model
and batch as its contestant, and one timed step is one optimizer step of the loop:
:meth:`~tandem.train.loop.Trainer.train_batch` (forward, loss, backward, optimizer step,
schedule, meter, progress) then :meth:`~tandem.train.loop.Trainer.after_step` (the stop
vote). Only the data loader is left out: the batch is already on the device. The optimizer,
loss and learning rate are the bench step's (weight decay 1e-4, no label smoothing, a
constant schedule), so the two compute the same update and differ by the loop's own cost.
"""

from __future__ import annotations

import contextlib
import functools
import sys

import torch
from torch import nn

from tandem.config import ModelConfig, OptimConfig, ParallelConfig, RunConfig, TrainConfig
from tandem.precision import Precision
from tandem.strategies.step_timer import rank_share, timed_devices
from tandem.train.build import make_criterion
from tandem.train.loop import Trainer
from tandem.train.recipe import make_optimizer
from tandem.train.schedule import make_scheduler

from .contestants import (Contestant, module_tensors, prepare_strategy, strategy_contestant,
                          uncounted_traffic)

BATCHES = 10 ** 9  # the twin's epoch never ends: no step is the epoch's last


def loop_config(strategy: str, arch: str, batch_size: int, amp: Precision, lr: float,
                print_freq: int = 0):
    """The :class:`~tandem.config.TrainConfig` of a twin: the bench step's update, no bar."""
    return TrainConfig(
        model=ModelConfig(arch=arch),
        optim=OptimConfig(batch_size=batch_size, lr=lr, momentum=0.9, weight_decay=1e-4,
                          label_smoothing=0.0, lr_schedule="constant"),
        parallel=ParallelConfig(strategy=strategy, amp=amp.dtype is not None,
                                amp_dtype=amp.amp_dtype),
        run=RunConfig(no_progress=True, print_freq=print_freq))


def loop_trainer(cfg, strategy, wrapped: nn.Module, precision: Precision, batches: int,
                 train_set=None):
    """The :class:`~tandem.train.loop.Trainer` of the bench's loop twins: ``cfg``'s optimizer,
    loss and schedule over ``batches`` a epoch, on ``wrapped`` (``strategy``'s model)."""
    optimizer = make_optimizer(cfg.optim, wrapped.parameters())
    return Trainer(cfg=cfg, strategy=strategy, model=wrapped,
                   criterion=make_criterion(cfg.optim, strategy), optimizer=optimizer,
                   scheduler=make_scheduler(optimizer, cfg.optim, batches),
                   scaler=precision.scaler(), precision=precision,
                   train_set=train_set, val_set=train_set, batches_per_epoch=batches,
                   config_dict={})


def loop_contestant(name: str, model: nn.Module, devices: list[torch.device],
                    batch: tuple[torch.Tensor, torch.Tensor], *, amp: Precision, lr: float,
                    arch: str = "bench", print_freq: int = 0, **setup) -> Contestant:
    """The loop twin of strategy ``name``: a :class:`Trainer` on ``model`` (which it takes
    over), stepped on ``batch`` (this rank's share of it, as the strategy's shares say).

    ``setup`` are :func:`~.contestants.prepare_strategy`'s keywords. With ``print_freq`` the
    loop's ``--print-freq`` lines go to stderr (stdout may carry the JSON).
    """
    strategy, wrapped, images, targets = prepare_strategy(name, model, devices, batch, **setup)
    cfg = loop_config(name, arch, len(targets), amp, lr, print_freq)
    trainer = loop_trainer(cfg, strategy, wrapped, amp, BATCHES)
    run = trainer.begin_epoch()
    out = contextlib.redirect_stdout(sys.stderr) if print_freq else contextlib.nullcontext()

    def step() -> torch.Tensor:
        x, y = rank_share(strategy, images, targets)
        with out:
            trainer.train_batch(run, trainer.position.batch, x, y)  # accum_steps 1: it steps
            trainer.after_step(run)
        return run.loss

    def close() -> None:
        run.progress.close()
        strategy.close()

    return Contestant(
        name=name, kind="strategy", devices=timed_devices(strategy), step=step,
        own_tensors=lambda: module_tensors(wrapped, trainer.optimizer, images, targets),
        counts_traffic=True, uncounted_traffic=uncounted_traffic(strategy, wrapped),
        close=close)


def build_strategy(entry, config, model: nn.Module, devices: list[torch.device],
                   batch: tuple[torch.Tensor, torch.Tensor]) -> Contestant:
    """Strategy contestant ``entry`` (an :class:`~.entry.Entry`, its loop twin too) of
    ``config`` (a :class:`~.config.BenchConfig`) on ``devices``, around ``model`` (which it
    takes over), named ``entry.name``."""
    make = strategy_contestant if not entry.loop else functools.partial(
        loop_contestant, arch=config.arch, print_freq=config.print_freq)
    contestant = make(
        entry.base, model, devices, batch,
        amp=entry.variant.precision(devices[0], config.amp_dtype), lr=config.lr,
        channels_last=entry.variant.channels_last, sync_bn=config.sync_bn,
        buffers=config.buffers, compiled=entry.compiled, compile_mode=config.compile_mode,
        split=entry.split, handicap=entry.handicap)
    contestant.name = entry.name
    return contestant
