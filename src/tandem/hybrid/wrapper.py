"""``HybridParallel``: data-parallel features, model-parallel classifier (Krizhevsky 2014).

Convs hold the compute and few parameters, so they run data parallel; FC layers hold the
parameters, so they are split by features (:mod:`.layout`) and only activations move. The
trunk is trained in place, but the head's Linear layers are *copied* into shards, so the
originals go stale (read back with :meth:`plain_state_dict` or :meth:`to_model`). Keyed dropout
(:mod:`tandem.keyed`) draws the plain model's masks; torch's draws others.
"""

from __future__ import annotations

import copy
from collections import OrderedDict

import torch
from torch import nn

from tandem.errors import UsageError
from tandem.plain_norms import PlainNorms

from ..parallel import DataParallelModel, gather
from ..parallel.devices import as_device, resolve_devices
from .column_linear import ColumnParallelLinear, RowParallelLinear, Shardwise
from .cost import meta_copy, plan
from .plain import (check_plain_keys, in_order, load_part, load_plain_optimizer_state,
                    plain_optimizer_state)
from .trunk import walk_head

_SPLIT = (ColumnParallelLinear, RowParallelLinear)


class _Gather(nn.Module):
    """The replicas' trunk outputs concatenated on the output device."""

    def __init__(self, output_device: torch.device):
        super().__init__()
        self.output_device = output_device

    def forward(self, chunks):
        return gather(list(chunks), self.output_device)


class HybridParallel(nn.Module):
    """Run ``model`` with a data-parallel trunk and a model-parallel classifier, a drop-in
    ``nn.Module`` whose logits land on ``output_device``.

    ``device_ids``, ``output_device`` (default ``device_ids[0]``), ``buffers`` (the trunk's),
    ``split``, ``max_share`` and ``backward_threads`` are as for ``DataParallel``; ``head``
    names the classifier (:mod:`.layout`). :meth:`parameters` yields each trainable tensor once
    (the trunk's shared ones, the shards' own); checkpoints use :meth:`plain_state_dict` and
    :meth:`plain_optimizer_state`. A model other than AlexNet's ``features, avgpool,
    classifier`` must call its head last, on ``(N, features)`` (:mod:`.trunk`).
    """

    plan = staticmethod(plan)

    def __init__(self, model: nn.Module, device_ids=None, output_device=None,
                 buffers: str = "replica0", head: str | None = None, split=None,
                 max_share: int | None = None, backward_threads: bool | None = None):
        super().__init__()
        mods, stages, key, trunk = walk_head(self, model, head, "HybridParallel")
        devices = resolve_devices(device_ids)
        self.devices = devices
        self.output_device = as_device(output_device) if output_device is not None else devices[0]
        self.trunk = DataParallelModel(trunk.to(devices[0]), devices, self.output_device,
                                       buffers=buffers, split=split, max_share=max_share,
                                       backward_threads=backward_threads)
        self.head = nn.Sequential(*self._split_head(mods, stages, key))
        object.__setattr__(self, "_skeleton", meta_copy(model))

    def _split_head(self, mods: list[nn.Module], stages, key) -> list[nn.Module]:
        """The head's stages: local layers on the output device, Linear layers split by
        columns (and rows, for a pair), each in ``self._parts`` under its plain ``key``."""
        devices, out = self.devices, self.output_device
        head: list[nn.Module] = []
        if not stages or stages[0].kind == "local":
            head.append(_Gather(out))
        for stage in stages:
            first, last = stage.indices[0], stage.indices[-1]
            if stage.kind == "local":
                head.append(mods[first].to(out))
                self._parts.append((key(first), head[-1]))
                continue
            column = ColumnParallelLinear.from_linear(
                mods[first], devices, gather_output=stage.kind == "column", output_device=out)
            head.append(column)
            self._parts.append((key(first), column))
            if stage.kind == "pair":
                head.append(Shardwise(*[mods[i] for i in stage.indices[1:-1]]))
                self._parts += [(key(i), mods[i]) for i in stage.indices[1:-1]]
                head.append(RowParallelLinear.from_linear(mods[last], devices, output_device=out))
                self._parts.append((key(last), head[-1]))
        return head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chunks = self.trunk(x)  # [replica i: (b_i, A) on devices[i]]
        return self.head(chunks)  # (N, classes) on output_device

    # -- the plain model's view ----------------------------------------------------------
    def plain_state_dict(self) -> "OrderedDict[str, torch.Tensor]":
        """The plain model's state dict: split layers merged into new tensors on the output
        device, shared modules' tensors as ``state_dict()`` returns them (not copied)."""
        state: dict = {}
        for prefix, module in self._parts:
            if isinstance(module, _SPLIT):
                weight, bias = module.merged_weight_bias()
                state[prefix + "weight"] = weight
                if bias is not None:
                    state[prefix + "bias"] = bias
            else:
                state.update((prefix + k, v) for k, v in module.state_dict().items())
        return in_order(state, self._keys, "HybridParallel")

    def _plain_pieces(self) -> list[tuple[str, list[torch.Tensor], int | None]]:
        """Where each of the plain model's parameters lives, in its order (:mod:`.plain`)."""
        where = {}
        for prefix, module in self._parts:
            if isinstance(module, _SPLIT):
                for key, (params, dim) in module.plain_pieces().items():
                    where[prefix + key] = (prefix + key, params, dim)
            else:
                for key, param in module.named_parameters():
                    where.setdefault(prefix + key, (prefix + key, [param], None))
        return [where[name] for name in self._param_names]

    def plain_norms(self) -> PlainNorms:
        """Norms of the plain model's parameters (a split layer's shards summed), on the
        output device."""
        params, owners = [], []
        for k, (_, shards, _) in enumerate(self._plain_pieces()):
            params += shards
            owners += [k] * len(shards)
        return PlainNorms(params, owners, device=self.output_device)

    def plain_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """``optimizer``'s state as the plain model's optimizer holds it (any strategy loads it)."""
        return plain_optimizer_state(optimizer, self._plain_pieces())

    def load_plain_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Load a plain model's optimizer state (any strategy's) into ``optimizer``, split
        layers taking their slices; a state per shard (older hybrid checkpoints) loads as is."""
        pieces = self._plain_pieces()
        counted = sum(len(group["params"]) for group in state["param_groups"])
        if counted == sum(len(g["params"]) for g in optimizer.param_groups) != len(pieces):
            optimizer.load_state_dict(state)
            return
        load_plain_optimizer_state(optimizer, pieces, state)

    def load_plain_state_dict(self, state: dict, strict: bool = True) -> None:
        """Load a plain model's state dict, split layers taking their slices; a key missing or
        extra (when ``strict``) or a wrong shape is an error."""
        if strict:
            check_plain_keys(self._keys, state, type(self._skeleton).__name__)
        for prefix, module in self._parts:
            if not isinstance(module, _SPLIT):
                load_part(module, state, prefix, self.head_name, strict)
            elif prefix + "weight" in state:
                try:
                    module.load_linear(state[prefix + "weight"], state.get(prefix + "bias"))
                except ValueError as exc:
                    raise UsageError(f"{prefix}weight: {exc}") from None
            elif strict:
                raise UsageError(f"plain state dict has no {prefix}weight")

    def to_model(self) -> nn.Module:
        """A new plain model on the output device holding a copy of the current weights, in
        this module's train/eval mode; non-persistent buffers are left uninitialised."""
        model = copy.deepcopy(self._skeleton).to_empty(device=self.output_device)
        model.load_state_dict(self.plain_state_dict())
        return model.train(self.training)
