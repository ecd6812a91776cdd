"""The plain model's layout for a model whose layers are split: its state dict and optimizer state.

Plain state is what every other strategy holds, so checkpoints move between strategies.
``pieces`` lists one ``(name, shard tensors, dim)`` per plain parameter, in its order (``dim``
``None``: not split); a split parameter's state is its shards' concatenated along ``dim``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch
from torch import nn

from tandem.errors import UsageError

from ..parallel.guards import first_lazy

Pieces = Sequence[tuple[str, list[torch.Tensor], "int | None"]]


def check_initialised(model: nn.Module, who: str) -> None:
    """Refuse a model with lazy layers: its head is split before any forward could size it."""
    lazy = first_lazy(model)
    if lazy is not None:
        raise UsageError(f"{who} needs an initialised model: {lazy!r} of {type(model).__name__} "
                         f"is lazy; run the model once on a batch before wrapping it")


def check_plain_keys(keys, state: dict, what: str) -> None:
    """Refuse, in one line, a plain state dict whose keys are not ``keys``: how many are
    missing and unexpected, with an example of each."""
    missing = [k for k in keys if k not in state]
    unexpected = [k for k in state if k not in keys]
    if missing or unexpected:
        raise UsageError(f"plain state dict does not fit {what}: {len(missing)} missing "
                         f"(e.g. {missing[:1]}), {len(unexpected)} unexpected "
                         f"(e.g. {unexpected[:1]})")


def in_order(state: dict, keys: list[str], who: str) -> "OrderedDict[str, torch.Tensor]":
    """``state`` in the plain model's key order; a key lost or extra is a bug of ``who``."""
    if set(state) != set(keys):
        raise RuntimeError(f"{who} lost track of keys: {sorted(set(state) ^ set(keys))[:3]}")
    return OrderedDict((k, state[k]) for k in keys)


def load_part(module: nn.Module, state: dict, prefix: str, head: str, strict: bool) -> None:
    """Load the entries of a plain ``state`` under ``prefix`` into ``module`` (prefix ``""``:
    the body, which holds every key but the head's)."""
    if prefix:
        sub = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    else:
        sub = {k: v for k, v in state.items() if not k.startswith(head + ".")}
    try:
        module.load_state_dict(sub, strict=strict)
    except RuntimeError as exc:
        raise UsageError(f"cannot load {prefix}*: {str(exc).strip().splitlines()[-1].strip()}"
                         ) from None


def block(value: torch.Tensor, dim: int, sizes: Sequence[int], j: int,
          what: str = "a split tensor") -> torch.Tensor:
    """Block ``j`` of a whole tensor cut along ``dim`` into ``sizes`` (a copy)."""
    if value.shape[dim] != sum(sizes):
        raise ValueError(f"{what} has shape {tuple(value.shape)}, {sum(sizes)} along "
                         f"dimension {dim} expected")
    return value.split(list(sizes), dim)[j].clone()


def _indices(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """``id(param) -> index`` as ``optimizer.state_dict()`` numbers its parameters."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {id(p): i for i, p in enumerate(params)}


def plain_optimizer_state(optimizer: torch.optim.Optimizer, pieces: Pieces) -> dict:
    """``optimizer.state_dict()`` in the plain layout."""
    saved, index = optimizer.state_dict(), _indices(optimizer)
    group_of = {id(p): g for g, group in enumerate(optimizer.param_groups)
                for p in group["params"]}
    groups = [dict(group, params=[]) for group in saved["param_groups"]]
    state = {}
    for k, (_, params, dim) in enumerate(pieces):
        groups[group_of[id(params[0])]]["params"].append(k)
        held = [saved["state"].get(index[id(p)]) for p in params]
        if all(h is not None for h in held):  # none before the first step
            state[k] = {key: torch.cat([s[key].to(value.device) for s in held], dim)
                        if dim is not None and torch.is_tensor(value) and value.dim() > 0
                        else value for key, value in held[0].items()}
    return {"state": state, "param_groups": groups}


def load_plain_optimizer_state(optimizer: torch.optim.Optimizer, pieces: Pieces,
                               plain: dict) -> None:
    """Load a plain-layout ``plain`` state into ``optimizer``, each split parameter's state
    cut into its shards' blocks. A state of another model is a ``ValueError``."""
    counted = sum(len(group["params"]) for group in plain["param_groups"])
    if counted != len(pieces):
        raise ValueError(f"it holds {counted} parameters' state, the model has {len(pieces)}")
    index, state = _indices(optimizer), {}
    for k, (name, params, dim) in enumerate(pieces):
        held = plain["state"].get(k)
        if held is None:
            continue
        sizes = [p.shape[dim] for p in params] if dim is not None else None
        for j, param in enumerate(params):
            state[index[id(param)]] = {
                key: block(value, dim, sizes, j, f"{name}'s {key}")
                if sizes is not None and torch.is_tensor(value) and value.dim() > 0 else value
                for key, value in held.items()}
    # torch matches saved and current parameters by their positions in the groups: the
    # optimizer's own order, each group with the settings of its plain group
    owner = {id(p): k for k, (_, params, _) in enumerate(pieces) for p in params}
    plain_group = {k: group for group in plain["param_groups"] for k in group["params"]}
    groups = [dict(plain_group[owner[id(group["params"][0])]],
                   params=[index[id(p)] for p in group["params"]])
              for group in optimizer.param_groups]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
