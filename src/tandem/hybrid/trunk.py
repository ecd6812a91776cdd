"""The data-parallel part of a hybrid model, everything before its Linear head."""

from __future__ import annotations

import copy

import torch
from torch import nn

from tandem.errors import UsageError

from .layout import classifier_layout, find_head, head_sequential
from .plain import check_initialised

_KNOWN_CHILDREN = ("features", "avgpool", "classifier")


class _Trunk(nn.Module):
    """features -> avgpool -> flatten -> leading elementwise layers (the data-parallel part)."""

    def __init__(self, features: nn.Module, avgpool: nn.Module | None, leading: list[nn.Module]):
        super().__init__()
        self.features = features
        self.avgpool = avgpool
        self.leading = nn.Sequential(*leading)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)  # N, C, h, w
        if self.avgpool is not None:
            x = self.avgpool(x)
        return self.leading(torch.flatten(x, 1))  # N, A


class _HeadInput(nn.Identity):
    """Stands in for the head inside the body: passes its input on and remembers it."""

    def forward(self, x):
        self.seen = x  # on this replica's own instance: replicas are separate objects
        return x


class _Body(nn.Module):
    """The model (sharing every submodule) with its head replaced by :class:`_HeadInput`, then
    the head's leading elementwise layers; a model doing more after its head is an error."""

    def __init__(self, model: nn.Module, head: str, leading: list[nn.Module]):
        super().__init__()
        body = copy.copy(model)
        body._modules = dict(model._modules)  # its own child table; the children are shared
        setattr(body, head, _HeadInput())
        self.body = body
        self.head = head
        self.leading = nn.Sequential(*leading)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        placeholder = getattr(self.body, self.head)
        placeholder.seen = None
        name = type(self.body).__name__
        try:
            out = self.body(x)  # N, A: the head's input
        except Exception as exc:  # what came after the head got the head's input instead
            if placeholder.seen is None:
                raise
            raise UsageError(self._not_last(name, f"does more after .{self.head} "
                                                  f"({exc})")) from exc
        seen, placeholder.seen = placeholder.seen, None
        if seen is None or out is not seen:
            raise UsageError(self._not_last(name, "never calls it" if seen is None else
                                            f"does more after .{self.head}"))
        if out.dim() != 2:
            raise UsageError(f"HybridParallel: {name}.{self.head} gets a {out.dim()}-D input "
                             f"{tuple(out.shape)}; it must get (N, features)")
        return self.leading(out)

    def _not_last(self, name: str, what: str) -> str:
        return (f"HybridParallel splits {name}.{self.head} as its last layer, but {name}.forward "
                f"{what}; name the last Linear layer with hybrid_head= (--hybrid-head)")


def trunk_of(model: nn.Module, name: str, leading: list[nn.Module]):
    """``(trunk, parts)``: the data-parallel part of ``model`` (sharing its modules) before its
    head ``model.<name>``, then ``leading``, and its (plain state dict prefix, module) pairs."""
    if (name == "classifier" and isinstance(getattr(model, "features", None), nn.Module)
            and all(n in _KNOWN_CHILDREN for n, _ in model.named_children())):  # AlexNet, VGG
        trunk = _Trunk(model.features, getattr(model, "avgpool", None), leading)
        parts = [("features.", trunk.features)]
        if trunk.avgpool is not None:
            parts.append(("avgpool.", trunk.avgpool))
        return trunk, parts
    trunk = _Body(model, name, leading)
    return trunk, [("", trunk.body)]  # every key but the head's


def walk_head(hybrid: nn.Module, model: nn.Module, head: str | None, who: str):
    """``(layers, stages, key, trunk)`` of ``model``'s head (found and checked as ``who``): its
    layers, their stages (:func:`~.layout.classifier_layout`), ``key(i)`` where layer ``i``
    keeps its state in the plain model, and :func:`trunk_of`'s trunk. Sets ``hybrid``'s
    ``head_name``, ``_parts`` (the trunk's and leading layers'), ``_keys`` and ``_param_names``
    (the plain model's)."""
    name = find_head(model, head, who=who)
    check_initialised(model, who)
    head_module = getattr(model, name)
    sequential = head_sequential(head_module)
    mods = list(sequential)
    leading, stages = classifier_layout(sequential)

    def key(i: int) -> str:
        return f"{name}.{i}." if isinstance(head_module, nn.Sequential) else f"{name}."

    trunk, parts = trunk_of(model, name, [mods[i] for i in leading])
    hybrid.head_name, hybrid._parts = name, parts + [(key(i), mods[i]) for i in leading]
    hybrid._keys = list(model.state_dict().keys())
    hybrid._param_names = [n for n, _ in model.named_parameters()]
    return mods, stages, key, trunk
