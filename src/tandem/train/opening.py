"""Opening a run: its directory made ready by the main process, and the lines said as it
starts or resumes."""

from __future__ import annotations

from tandem.distributed.env import cpu_bf16_override, restart_count
from tandem.precision import amp_precision

from .loop import Trainer
from .metrics import MetricsLog
from .plan import FORKED, FRESH, RESUMED, RunPlan
from .start import example_block, precision_line, size_line

__all__ = ["open_run_dir", "say_starting"]


def open_run_dir(plan: RunPlan, trainer: Trainer, notes: list[str]) -> MetricsLog | None:
    """Make the plan's run directory what the run needs (the main process writes); say how
    a resume goes on; the metrics log to append to (``None`` on other processes)."""
    strategy, run = plan.strategy, plan.run_dir
    strategy.barrier()  # every process has checked --out before the main one writes there
    if not strategy.is_main:
        return None
    run.create()
    if plan.mode != RESUMED:
        run.clear()
    if plan.mode == FORKED:
        run.fork_from(plan.source)
    if plan.checkpoint is not None:
        _say_resuming(trainer, plan.resume_path, notes)
    if plan.mode != RESUMED:  # a resume's changes go in with its next checkpoint (Trainer.save)
        run.write_config(trainer.config_dict)
    return run.metrics_log(keep_epochs=None if plan.mode == FRESH else trainer.position.epoch)


def _say_resuming(trainer: Trainer, path: str, notes: list[str]) -> None:
    """The ``resuming`` line (naming a torchrun restart), then one line per accepted change."""
    pos, restarts = trainer.position, restart_count()
    print(f"resuming {path} at epoch {pos.epoch + 1}/{trainer.cfg.optim.epochs}, step "
          f"{pos.step} ({pos.batch}/{trainer.batches_per_epoch} batches of the epoch done)"
          + (f" (torchrun restart {restarts})" if restarts else ""), flush=True)
    for note in notes:
        print(f"  {note}", flush=True)


def say_starting(plan: RunPlan, trainer: Trainer) -> None:
    """The command line's own lines (:attr:`~.plan.RunPlan.opening`), a fresh run's image
    size and how tandem's defaults differ from the imagenet example's
    (a run from another program's file says both in :func:`.foreign.assumed`); any run's
    precision under ``--amp``."""
    cfg, lines = trainer.cfg, list(plan.opening)
    if plan.checkpoint is None and plan.supplied.data is None:  # a file's: foreign.assumed
        size = trainer.config_dict["resolved"]["dataset"]["image_size"]
        lines += [size_line(cfg, plan.given, size), *example_block(cfg, plan.given)]
    p = cfg.parallel
    lines.append(precision_line(amp_precision(plan.strategy.device.type, p.amp, p.amp_dtype,
                                              cpu_bf16=cpu_bf16_override()), " (--amp)"))
    for line in lines:
        if line:
            print(line, flush=True)
