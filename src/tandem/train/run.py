"""Running a :class:`~tandem.config.TrainConfig` (:mod:`.settings` → :mod:`.plan` →
:mod:`.build` → :mod:`.loop`): ``tandem train``, ``tandem.fit`` and ``tandem eval``'s pass."""

from __future__ import annotations

import contextlib
import time

import torch

from tandem import checkpoint, cpu_malloc
from tandem.config import TrainConfig
from tandem.distributed import launch_state, membership
from tandem.distributed.compression import POWERSGD_START
from tandem.distributed.env import Environment
from tandem.distributed.faults import ABORTS
from tandem.distributed.process_group import Job
from tandem.distributed.resume_command import resume_command_here
from tandem.errors import UsageError
from tandem.hybrid.cost import gradient_bytes
from tandem.model_state import load_plain_state_dict
from tandem.strategies.outputs import label_smoothing

from . import runlock, settings
from .build import build, data, make_criterion, prepared_model, resumed, with_model_classes
from .interrupt import StopRequest
from .loop import Trainer
from .writer import Writer
from .metrics import MetricsLog, eval_scores
from .plan import RunPlan, plan_train
from .recipe import lr_line
from .rundir import EVALUATE, FORKED, FRESH, RESUMED


def train(cfg: TrainConfig, given: frozenset[str] = frozenset(),
          opening: tuple[str, ...] = (), environ: Environment = Environment()) -> int:
    """``tandem train``: fit (or only validate). ``given``: fields typed on the command line;
    ``opening``: lines to say as the run starts; ``environ``: the variables, as read once."""
    with Job() as job:  # every check, before anything is done
        execute(plan_train(cfg, given, opening=opening, job=job, environ=environ))
    return 0


def execute(plan: RunPlan | str) -> dict | None:
    """Run ``plan``: fit, or validate only; return the last metrics row (the validation's
    with ``-e``) on the main process, else ``None``. A supplied model keeps the final weights."""
    if isinstance(plan, str):  # a complete run: one line, from the first process
        if plan:
            print(plan, flush=True)
        return None
    if plan.mode == EVALUATE:
        return _print_validation(plan)
    locked = (runlock.held(plan.run_dir, plan.place) if plan.strategy.is_main else
              contextlib.nullcontext())
    cpu_malloc.tune(plan.place.malloc_default)  # a process that trains keeps its step's memory
    with locked, plan.strategy as strategy:  # joins the process group (ddp); always leaves it
        parts = build(plan)
        start, notes = resumed(plan, parts)
        facts, change = _run_facts(plan, start)
        trainer = Trainer(**parts, **start, **facts)
        _compile_now(trainer, train=True)
        log = open_run_dir(plan, trainer, [change, *notes] if change else notes)
        if strategy.is_main:
            say_starting(plan, trainer)
        with StopRequest(quiet=not plan.place.speaks, when=strategy.stops_when) as stop:
            records = trainer.fit(log, stop)
        if plan.supplied.model is not None:
            load_plain_state_dict(plan.supplied.model, strategy.state_dict(trainer.model))
        strategy.barrier()
        trainer.writer.flush()  # rank 0's files, after the ranks' last collective
    return records[-1] if records and strategy.is_main else None


def _run_facts(plan: RunPlan, start: dict) -> tuple[dict, str | None]:
    """The trainer's fields from the job (the step ``--out`` holds, writer, launch state), and
    the line a change of the job's machines says since the checkpoint was saved (or None)."""
    strategy, out = plan.strategy, plan.cfg.run.out
    position = start.get("position")
    kept = position.step if plan.mode == RESUMED and position is not None else None
    state = launch_state.LaunchState.of_worker(plan.place.environ, plan.place.speaks)
    # the workers that ended last on this node told its launcher their last completed step
    ended = launch_state.read(state.path).get("completed") if state is not None else None
    change = None
    if kept is not None and strategy.multiprocess:  # the same on every rank: a collective
        completed = membership.completed_steps(strategy.agreement, ended)
        change = membership.change_line(plan.checkpoint.get("members"),
                                        membership.of(strategy.agreement), kept, completed)
    if state is not None:
        state.update(run=out, checkpoint=plan.run_dir.latest, saved_step=kept,
                     speaker=strategy.rank, aborts=strategy.failure_model == ABORTS,
                     peers={str(r): list(p) for r, p in strategy.agreement.peers.items()},
                     resume=resume_command_here(out, strategy.agreement.env, this_node=True))
    slow = strategy.agreement.env.timeout if strategy.multiprocess else None
    told = state.saved if state is not None and strategy.is_main else None
    return {"kept_at_start": kept, "writer": Writer(slow_after=slow, on_written=told),
            "launch_state": state}, change


# -- the run directory, and the lines said as a run starts ----------------------------------------
def open_run_dir(plan: RunPlan, trainer: Trainer, notes: list[str]) -> MetricsLog | None:
    """Prepare the run directory; the metrics log (``None`` on other processes)."""
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
        _say_resuming(trainer, plan.resume_path, notes, plan.place.restart)
    if plan.mode != RESUMED:  # a resume's changes go in with its next checkpoint (Trainer.save)
        run.write_config(trainer.config_dict)
    return MetricsLog(run.metrics, keep_epochs=None if plan.mode == FRESH else
                      trainer.position.epoch)


def _say_resuming(trainer: Trainer, path: str, notes: list[str], restarts: int) -> None:
    """The ``resuming`` line, then one line per change."""
    pos = trainer.position
    print(f"resuming {path} at epoch {pos.epoch + 1}/{trainer.cfg.optim.epochs}, step "
          f"{pos.step} ({pos.batch}/{trainer.batches_per_epoch} batches of the epoch done)"
          + (f" (torchrun restart {restarts})" if restarts else ""), flush=True)
    for note in notes:
        print(f"  {note}", flush=True)


def say_starting(plan: RunPlan, trainer: Trainer) -> None:
    """The opening lines: the command line's, a fresh run's image size and defaults that
    differ from the imagenet example's, the precision and the learning rate."""
    cfg, lines = trainer.cfg, list(plan.opening)
    if plan.checkpoint is None and plan.supplied.data is None:  # a file's: settings.assumed
        size = trainer.config_dict["resolved"]["dataset"]["image_size"]
        lines += [settings.size_line(cfg, plan.given, size),
                  *settings.example_block(cfg, plan.given)]
    lines.append(settings.precision_line(plan.precision, " (--amp)"))
    if plan.strategy.compressor is not None:
        lines.append(compression_line(plan.strategy.compressor))
    lines.append(lr_line(cfg.optim))
    for line in lines:
        if line:
            print(line, flush=True)


def compression_line(compressor) -> str:
    """What ``--grad-compression`` sends a step against exact ddp (the cost model's bytes)."""
    c, w = compressor.compression, compressor.world
    sent = gradient_bytes(compressor.parameters, w, c)
    exact = gradient_bytes(compressor.parameters, w)
    how = (f"{c} with error feedback from step {POWERSGD_START + 1}" if c.mode == "powersgd"
           else f"{c}")
    return (f"gradients: {how}, an approximate update (not single's); each rank sends "
            f"{sent / 1e6:.2f} MB a step against {exact / 1e6:.2f} MB exact "
            f"({sent / exact if exact else 1:.2f}x)")


# -- validation only -----------------------------------------------------------------------------
def _print_validation(plan: RunPlan) -> dict | None:
    """``train -e``: validate and print one line (and what a file from elsewhere assumed)."""
    result = validate(plan)
    if not result["is_main"]:
        return None
    for note in plan.notes:
        print(note.replace(settings.DATA_SIZE, f"{result['image_size']}px"))
    if result["precision"]:
        print(result["precision"])
    print(f"{eval_scores(result)} ({result['count']} images)")
    return {"val_loss": result["loss"], "val_acc": result["acc1"],
            "val_acc5": result["acc5"], "count": result["count"]}


def validate(plan: RunPlan) -> dict:
    """One pass over the validation set of the plan's model (``tandem eval``, ``train -e``)."""
    with plan.strategy as strategy:
        _, val_set, info = data(plan, splits=("val",))
        if val_set is None:
            raise UsageError("no validation data to evaluate on (val_data is None)")
        cfg = with_model_classes(plan.cfg, info, plan.checkpoint)
        trainer = Trainer(cfg=cfg, strategy=strategy,
                          model=prepared_model(plan, cfg, info, val_set),
                          criterion=make_criterion(cfg.optim, strategy, plan.supplied.criterion),
                          optimizer=None, scheduler=None, scaler=None, train_set=None,
                          val_set=val_set, batches_per_epoch=0, config_dict={},
                          precision=plan.precision)
        seconds = _compile_now(trainer, train=False)
        val = trainer.validate()
        smoothing = label_smoothing(trainer.criterion)
        return {"arch": cfg.model.arch, "loss": val.loss, "label_smoothing": smoothing,
                "plain_ce": val.ce if smoothing else None, "acc": val.acc, "acc1": val.acc,
                "acc5": val.acc5, **({"miou": val.miou} if val.dense else {}), "count": val.count,
                "compile_seconds": seconds, "is_main": strategy.is_main,
                "image_size": info.image_size, "precision": settings.precision_line(plan.precision)}


# -- --compile: compiled before the clock starts ---------------------------------------------------
def _compile_now(trainer: Trainer, train: bool) -> float | None:
    """With ``--compile``: compile now, before any clock runs; the seconds, else None."""
    if not trainer.cfg.parallel.compile:
        return None
    seconds = warm_up(trainer, train=train)
    if train and trainer.strategy.is_main:
        print(describe_compile(seconds, trainer.cfg.parallel.compile_mode), flush=True)
    return seconds


def warm_up(trainer: Trainer, train: bool = True) -> float:
    """Compile the training (if ``train``) and evaluation calls now; return the seconds.

    Each call is made twice (the second one sample short, so any batch size compiles), then
    weights, BN stats, grads, RNG and mode are restored. Every process must call it.
    """
    model = trainer.model
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    device = trainer.strategy.device
    rng, mode = checkpoint.capture_rng(device), model.training
    start = time.perf_counter()
    try:
        if train:
            _rehearse(trainer, trainer.train_set, train=True)
        _rehearse(trainer, trainer.val_set, train=False)
    finally:
        with torch.no_grad():
            model.load_state_dict(saved)
        for param in model.parameters():
            param.grad = None
        checkpoint.restore_rng(rng, device)
        model.train(mode)
        trainer.strategy.split.discard()  # --split auto must not take the compile for a step
    return time.perf_counter() - start


def _rehearse(trainer: Trainer, dataset, train: bool) -> None:
    """A forward (and backward) of this process's share of the first global batch."""
    loader = [] if dataset is None else trainer.loader(dataset, train=train,
                                                       epoch=trainer.position.epoch)
    batch = next((trainer.device_batch(*b) for b in loader), None)  # a mixed batch: three
    if batch is None:
        return
    s, model = trainer.strategy, trainer.model
    model.train(train)
    # the same on every process (a ddp forward is a collective): from the config
    shorter = trainer.cfg.optim.batch_size >= 3 * s.world_size  # every share keeps >= 2
    for images, targets in [batch, tuple(t[:-1] for t in batch)][:1 + shorter]:
        with torch.set_grad_enabled(train), s.no_sync(model), trainer.autocast():
            out = s.forward_loss(model, trainer.criterion, images, targets)
        if train:
            with s.no_sync(model):  # a rehearsal: no gradient all-reduce between processes
                out.loss.backward()


def describe_compile(seconds: float, mode: str | None) -> str:
    """The line that reports compile time, apart from step times."""
    return (f"compiled the model in {seconds:.1f}s (torch.compile, mode {mode or 'default'}); "
            f"not counted in step times or img/s")
