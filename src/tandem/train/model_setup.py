"""The model a run trains or validates: built on the CPU from a seed (initial weights never
depend on devices), checked against a user's data, set up by the strategy and given its
weights (the checkpoint's, or ``--pretrained``)."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import torch
from torch import nn

from tandem import checkpoint
from tandem.checkpoint import compat as checkpoint_compat
from tandem.config import ModelConfig, TrainConfig
from tandem.data.given import GivenDataset
from tandem.errors import UsageError, first_line
from tandem.factory import is_reference
from tandem.models import create_model, model_info
from tandem.pretrained import load_pretrained
from tandem.strategies.compile import compiled

from .plan import RunPlan, check_model

__all__ = ["seed_everything", "build_model", "with_model_classes", "check_inputs",
           "prepared_model"]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def build_model(cfg: ModelConfig, info, seed: int) -> nn.Module:
    """Seed, then create ``cfg.arch`` on the CPU for ``info``'s classes, channels and size."""
    minimum = model_info(cfg.arch).min_input_size  # unknown arch: ValueError listing them
    if info.image_size < minimum:
        raise UsageError(f"--arch {cfg.arch} needs images of at least {minimum}px, but "
                         f"{info.name} gives {info.image_size}px (set --image-size)")
    kwargs = {} if cfg.dropout is None else {"dropout": cfg.dropout}
    seed_everything(seed)
    return create_model(cfg.arch, num_classes=info.num_classes, in_channels=info.in_channels,
                        **kwargs)


def with_model_classes(cfg: TrainConfig, info, ckpt: dict | None) -> TrainConfig:
    """``cfg`` with ``data.num_classes`` set to the classes the model will output.

    ``--num-classes`` when given; else a checkpoint's classifier when it is larger than the
    data's classes (the imagenet example's files always have 1000); else the data's. The
    run's config records it, so its checkpoints rebuild the same model for eval and resume.
    """
    classes = cfg.data.num_classes
    if classes is None:
        layer = checkpoint_compat.final_layer(ckpt["state_dict"]) if ckpt is not None else None
        classes = layer[1] if layer and layer[1] > info.num_classes else info.num_classes
    return replace(cfg, data=replace(cfg.data, num_classes=classes))


def check_inputs(model: nn.Module, dataset, dtype: torch.dtype) -> None:
    """Refuse, in one line, a model that cannot take a user's data set's inputs (flat vectors
    into a conv net): one forward of a batch of one zero input, in eval mode (no state
    changes), that says which shape the model got."""
    if not isinstance(dataset, GivenDataset):
        return
    x = torch.zeros((1, *dataset.shape), dtype=dtype)
    was_training = model.training
    try:
        with torch.no_grad():
            model.eval()
            model(x)
    except (RuntimeError, ValueError) as exc:  # shape and size mismatches
        raise UsageError(f"the model cannot take {dataset.name}'s inputs: it got a batch of "
                         f"shape {tuple(x.shape)} (inputs of shape {dataset.shape}) and "
                         f"raised {type(exc).__name__}: {first_line(exc)}") from None
    finally:
        model.train(was_training)


def prepared_model(plan: RunPlan, cfg: TrainConfig, info, dataset=None) -> nn.Module:
    """The model of ``cfg`` (``cfg.data.num_classes`` outputs, see :func:`with_model_classes`)
    set up by the plan's strategy, then given its weights by it (the checkpoint's, or
    ``--pretrained``): the same for training and for validation."""
    strategy, ckpt, given = plan.strategy, plan.checkpoint, plan.supplied.model
    if given is None:
        model = build_model(cfg.model, replace(info, num_classes=cfg.data.num_classes),
                            cfg.run.seed)
        if is_reference(cfg.model.arch):  # a factory's model, seen for the first time (the
            check_model(strategy, model)  # plan checked a zoo model on the meta device)
    else:  # the user's model, its weights as they are; the RNG where a built one starts
        seed_everything(cfg.run.seed)
        model = given
    model = model.to(getattr(torch, cfg.parallel.dtype))
    check_inputs(model, dataset, getattr(torch, cfg.parallel.dtype))
    if cfg.parallel.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if cfg.parallel.compile:
        model = compiled(model, cfg.parallel.compile_mode)
    wrapped = strategy.setup(model)
    if ckpt is not None:
        checkpoint.load_weights(wrapped, ckpt["state_dict"], cfg.run.resume,
                                strategy.load_state_dict)
    elif cfg.model.pretrained:
        line = load_pretrained(wrapped, cfg.model.pretrained, cfg.model.arch, strategy)
        if strategy.is_main:
            print(line, flush=True)
    return wrapped
