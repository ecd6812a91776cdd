"""``tandem.fit``: train a model and data sets of your own, as ``tandem train`` does.

    import tandem
    row = tandem.fit(model, train_data, val_data, strategy="balanced", devices="cpu:3",
                     batch_size=64, epochs=10, out="runs/mine", sync_bn=True)

It runs the CLI's own path (:func:`tandem.train.run.execute`: plan, build, restore, fit) with
what it is handed in place of what ``--arch`` and ``--data`` name, so it writes the same run
directory and ``resume=`` continues it exactly. Under torchrun (``tandem launch``) the same
call is one rank of a multi-process job.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from torch import nn

from tandem.config import TrainConfig
from tandem.data.given import given_data
from tandem.data.load import GIVEN_DATA
from tandem.distributed.env import Environment
from tandem.distributed.process_group import Job
from tandem.errors import UsageError, a
from tandem.train.plan import Supplied, plan_train
from tandem.train.rundir import RunDir, checkpoint_path
from tandem.train.run import execute


def fit(model: nn.Module | None, train_data, val_data=None, *, criterion: Callable | None = None,
        classes=None, **settings) -> dict | None:
    """Train ``model`` on ``train_data``, validating on ``val_data`` after every epoch.

    Warning: the model's initial weights are used as they are (seed them yourself), and with
    several processes, rank 0's. Under torchrun a one-process ``strategy`` becomes one process
    per device (``ddp``), and one line says so. As ``tandem train`` does, training sets glibc's
    malloc thresholds for the whole process, which then keeps its peak memory
    (:mod:`tandem.cpu_malloc`; ``TANDEM_MALLOC=default`` keeps glibc's own behaviour).

    :param model: the model to train; it is left holding the final weights (they are also in
        ``out``/``checkpoint.pt``). ``None`` builds ``arch``, as the CLI does.
    :param train_data: a map-style data set of ``(input, target)`` pairs: floating-point
        inputs of one shape, class-index targets (or tensors of them: masks). ``None`` loads
        ``data``, as the CLI does.
    :param val_data: the same for validation after every epoch; ``None``: no validation (no
        ``best.pt``, and the rows' validation fields are null).
    :param criterion: the loss, ``criterion(outputs, targets)``; default cross-entropy with
        ``ignore_index`` and ``label_smoothing``. It is not saved: a resume is handed it again.
    :param classes: the class names (their count is the model's outputs); default the data
        sets' own ``classes``, else the largest target + 1.
    :param settings: ``tandem train``'s settings under the config's field names
        (``batch_size=64``, ``strategy="dp"``, ``devices="cpu:3"``, ``epochs=10``,
        ``out="runs/mine"``, ``resume="runs/mine"``, ...), with the same checks and one-line
        errors (:class:`~tandem.errors.UsageError`).
    :returns: the last metrics row (a ``metrics.jsonl`` row; with ``evaluate=True`` the
        validation's figures), on the main process; ``None`` on the other ranks of a launch.
    """
    cfg = TrainConfig.from_settings(settings)
    if model is not None and "arch" in settings:
        raise UsageError("tandem.fit() got a model and arch=: give one of them")
    if train_data is not None and "data" in settings:
        raise UsageError("tandem.fit() got train_data and data=: give one of them")
    if model is not None and not isinstance(model, nn.Module):
        raise UsageError(f"tandem.fit(): model is {a(type(model).__name__)}, not a torch.nn.Module")
    if model is not None:  # what the run's config says built it (re-importable if a module's)
        arch = f"{type(model).__module__}:{type(model).__qualname__}"
        cfg = replace(cfg, model=replace(cfg.model, arch=arch))
    data = None
    if train_data is not None:
        data = given_data(train_data, val_data, classes, name="tandem.fit()",
                          augment=cfg.data.augment, reprob=cfg.data.reprob,
                          image_size=cfg.data.image_size, num_classes=cfg.data.num_classes)
        cfg = replace(cfg, data=replace(cfg.data, data=GIVEN_DATA))
    elif val_data is not None or classes is not None:
        raise UsageError("tandem.fit() got val_data or classes without train_data")
    with Job() as job:  # several processes: the job's group, for this run
        plan = plan_train(cfg, frozenset(settings), Supplied(model, data, criterion, by_fit=True),
                          job=job, environ=Environment.read())
        row = execute(plan)
    if isinstance(plan, str) and plan:  # complete already (the line: on the main process)
        rows = RunDir.of(checkpoint_path(cfg.run.resume)).read_metrics()
        return rows[-1] if rows else None
    return row

