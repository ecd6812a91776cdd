"""``tandem eval``: validate a checkpoint with its run's own settings, or those given."""

from __future__ import annotations

from dataclasses import replace

from tandem import checkpoint
from tandem.config import ParallelConfig, TrainConfig
from tandem.data.load import GIVEN_DATA
from tandem.distributed.env import Place
from tandem.errors import UsageError, param
from tandem.factory import is_reference

from . import runlock, settings
from .plan import plan_eval
from .rundir import checkpoint_path as checkpoint_path_of, example_file_note
from .run import validate


def _run_precision(parallel: ParallelConfig, saved: TrainConfig, amp: bool | None,
                   amp_dtype: str | None) -> tuple[ParallelConfig, str]:
    """``parallel`` with the ``--amp`` an eval asks for, and where it came from."""
    if amp is not None or amp_dtype is not None:
        return replace(parallel, amp=bool(amp) or amp_dtype is not None,
                       amp_dtype=amp_dtype), " (as given)"
    if not saved.parallel.amp:
        return replace(parallel, amp=False, amp_dtype=None), ""
    return (replace(parallel, amp=True, amp_dtype=saved.parallel.amp_dtype),
            " (the run's --amp; --no-amp for float32)")


def _averaged(ckpt: dict, path: str) -> dict:
    """``ckpt`` with its EMA of the weights (``--model-ema``'s) as its weights."""
    entry = ckpt.get("ema")
    if not isinstance(entry, dict) or not isinstance(entry.get("state_dict"), dict):
        raise UsageError(f"checkpoint '{path}' holds no EMA of the weights (its run trained "
                         f"without {param('model_ema')}): leave out {param('ema')}")
    return dict(ckpt, state_dict=entry["state_dict"])


def evaluate(checkpoint_path: str, *, parallel: ParallelConfig, data: dict | None = None,
             batch_size: int | None = None, seed: int | None = None,
             label_smoothing: float | None = None, arch: str | None = None, amp: bool | None = None,
             amp_dtype: str | None = None, ema: bool = False, place: Place) -> dict:
    """Validate the checkpoint at ``checkpoint_path``; return its loss and accuracies.

    Its run's settings, each overridden by an argument given; ``arch`` for a file that names
    none. A tandem run is evaluated at its own image size and precision (float32, said, where
    it cannot run here); a file from elsewhere as the imagenet example does, said in ``note``.
    ``place``: this process, as the caller read it once (``place_of``).
    """
    runlock.check_saved(checkpoint_path, place)  # a run not saved yet: its process, named
    checkpoint_path = checkpoint_path_of(checkpoint_path)  # a run directory: its latest
    ckpt = checkpoint.load(checkpoint_path)
    if ema:
        ckpt = _averaged(ckpt, checkpoint_path)
    newer = example_file_note(checkpoint_path, (data or {}).get(
        "data", ((ckpt.get("config") or {}).get("data") or {}).get("data")), evaluate=True)
    arch = settings.checkpoint_arch(ckpt, arch, checkpoint_path)
    saved = TrainConfig.from_dict(ckpt.get("config") or {})
    optim = replace(saved.optim, **{k: v for k, v in (("batch_size", batch_size),
                                                       ("label_smoothing", label_smoothing))
                                    if v is not None})
    parallel, source = _run_precision(parallel, saved, amp, amp_dtype)
    trained_at = ((ckpt.get("config") or {}).get("resolved") or {}).get("dataset") or {}
    spec = (data or {}).get("data", saved.data.data)
    if saved.data.image_size is None and trained_at.get("image_size") and \
            not is_reference(spec) and spec != GIVEN_DATA:  # the run's own size (tandem's data)
        saved = replace(saved, data=replace(saved.data, image_size=trained_at["image_size"]))
    cfg = TrainConfig(model=replace(saved.model, arch=arch),
                      data=replace(saved.data, **(data or {})), optim=optim, parallel=parallel,
                      run=saved.run if seed is None else replace(saved.run, seed=seed))
    note = None
    if settings.is_foreign(ckpt):
        given = set(data or {}) | ({"label_smoothing"} if label_smoothing is not None else set())
        cfg, note = settings.eval_settings(cfg, frozenset(given), checkpoint_path)
    cfg = replace(cfg, run=replace(cfg.run, resume=checkpoint_path))
    plan = plan_eval(cfg, ckpt, place=place, fall_back=amp is None and amp_dtype is None)
    result = validate(plan)
    if note:
        note = note.replace(settings.DATA_SIZE, f"{result['image_size']}px")
    note = "\n".join(n for n in (newer, note) if n) or None
    if result["precision"]:
        result["precision"] += source
    elif plan.notes:  # float32 in place of the run's --amp, which cannot run here
        result["precision"] = plan.notes[-1]
    return dict(result, note=note)
