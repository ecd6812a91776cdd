"""An optimizer's state in the plain model's layout, for a model whose layers are split.

A split layer's parameter lives in several shard parameters; the plain model has one. The
plain layout numbers parameters as the plain model's ``parameters()`` does, and holds each
split parameter's per-parameter state (momentum) as the shards' states concatenated along the
split dimension: what any other strategy's optimizer holds, so checkpoints move between
strategies. ``pieces`` describes the layout: one ``(name, shard_params, dim)`` per plain
parameter, in its order (``dim`` ``None``: one parameter, not split).
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["plain_optimizer_state", "load_plain_optimizer_state"]

Pieces = Sequence[tuple[str, list[torch.Tensor], "int | None"]]


def _indices(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """``id(param) -> index`` as ``optimizer.state_dict()`` numbers its parameters."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {id(p): i for i, p in enumerate(params)}


def _merge(states: list[dict], dim: int | None) -> dict:
    """One parameter's state from its shards' (tensors concatenated along ``dim``)."""
    merged = {}
    for key, value in states[0].items():
        if dim is not None and torch.is_tensor(value) and value.dim() > 0:
            value = torch.cat([s[key].to(value.device) for s in states], dim)
        merged[key] = value
    return merged


def plain_optimizer_state(optimizer: torch.optim.Optimizer, pieces: Pieces) -> dict:
    """``optimizer.state_dict()`` in the plain layout (see the module docstring)."""
    saved, index = optimizer.state_dict(), _indices(optimizer)
    group_of = {id(p): g for g, group in enumerate(optimizer.param_groups)
                for p in group["params"]}
    groups = [dict(group, params=[]) for group in saved["param_groups"]]
    state = {}
    for k, (_, params, dim) in enumerate(pieces):
        groups[group_of[id(params[0])]]["params"].append(k)
        held = [saved["state"].get(index[id(p)]) for p in params]
        if all(h is not None for h in held):  # none before the first step
            state[k] = _merge(held, dim)
    return {"state": state, "param_groups": groups}


def load_plain_optimizer_state(optimizer: torch.optim.Optimizer, pieces: Pieces,
                               plain: dict) -> None:
    """Load a plain-layout ``plain`` state into ``optimizer``, each split parameter's state
    cut into its shards' slices. A state of another model is a ``ValueError``."""
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
            part = {}
            for key, value in held.items():
                if sizes is not None and torch.is_tensor(value) and value.dim() > 0:
                    if value.shape[dim] != sum(sizes):
                        raise ValueError(f"{name}'s {key} has shape {tuple(value.shape)}, "
                                         f"{sum(sizes)} along dimension {dim} expected")
                    value = value.split(sizes, dim)[j].clone()
                part[key] = value
            state[index[id(param)]] = part
    # torch matches saved and current parameters by their positions in the groups: the
    # optimizer's own order, each group with the settings of its plain group
    owner = {id(p): k for k, (_, params, _) in enumerate(pieces) for p in params}
    plain_group = {k: group for group in plain["param_groups"] for k in group["params"]}
    groups = [dict(plain_group[owner[id(group["params"][0])]],
                   params=[index[id(p)] for p in group["params"]])
              for group in optimizer.param_groups]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
