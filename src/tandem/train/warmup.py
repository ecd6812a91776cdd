"""Compiling before the clock starts, so that compile time never counts as training time.

:func:`warm_up` makes ``torch.compile``'s first calls on purpose (train and eval, each twice,
the second one sample short so any batch size compiles), then restores everything they touched
(weights, BN stats, grads, RNG, mode): the run computes exactly what it would have without it.
"""

from __future__ import annotations

import time

import torch

from tandem import checkpoint

from .loop import Trainer

__all__ = ["warm_up", "describe"]


def _first_batch(trainer: Trainer, dataset, train: bool):
    """This process's share of the first global batch (maybe empty under ddp, as in the loop)."""
    loader = trainer.loader(dataset, train=train, epoch=trainer.position.epoch)
    for images, targets in loader:
        return trainer.device_batch(images, targets)
    return None


def _run(trainer: Trainer, dataset, train: bool) -> None:
    batch = _first_batch(trainer, dataset, train) if dataset is not None else None
    if batch is None:
        return
    s, model = trainer.strategy, trainer.model
    model.train(train)
    # The same decision on every process (a ddp forward is a collective): from the config.
    shorter = trainer.cfg.optim.batch_size >= 3 * s.world_size  # every share keeps >= 2
    for images, targets in [batch, tuple(t[:-1] for t in batch)][:1 + shorter]:
        with torch.set_grad_enabled(train), s.no_sync(model), trainer.autocast():
            out = s.forward_loss(model, trainer.criterion, images, targets)
        if train:
            with s.no_sync(model):  # a rehearsal: no gradient all-reduce between processes
                out.loss.backward()


def warm_up(trainer: Trainer, train: bool = True) -> float:
    """Compile the training (if ``train``) and evaluation calls now; return the seconds taken.

    Every process must call it (a ddp forward still all-reduces its loss).
    """
    model = trainer.model
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    device = trainer.strategy.device
    rng, mode = checkpoint.capture_rng(device), model.training
    start = time.perf_counter()
    try:
        if train:
            _run(trainer, trainer.train_set, train=True)
        _run(trainer, trainer.val_set, train=False)
    finally:
        with torch.no_grad():
            model.load_state_dict(saved)
        for param in model.parameters():
            param.grad = None
        checkpoint.restore_rng(rng, device)
        model.train(mode)
        trainer.strategy.split.discard()  # --split auto must not take the compile for a step
    return time.perf_counter() - start


def describe(seconds: float, mode: str | None) -> str:
    """The line that reports compile time, apart from step times."""
    return (f"compiled the model in {seconds:.1f}s (torch.compile, mode {mode or 'default'}); "
            f"not counted in step times or img/s")
