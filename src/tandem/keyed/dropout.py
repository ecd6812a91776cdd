"""Dropout and drop path whose masks are keyed by sample, so that a run is the same on 1 device
or N: sample ``i``'s element, channel or whole branch is dropped when its word
(:func:`~.keys.words`, this call's key: :mod:`.stream`) is below the threshold of ``p``.

Outputs follow torch's formulas; the backward keeps the boolean mask alone. In eval mode, at
``p`` 0 or 1, or outside a stream they are torch's own layers (which they subclass).
"""

from __future__ import annotations

import torch
from torch import nn

from . import stream
from .keys import row_words, threshold, words

_ALPHA = 1.7580993408473766  # SELU's alpha times its scale: a dropped value is minus this


class _Scaled(torch.autograd.Function):
    """``x * keep / (1 - p)``; the backward keeps ``keep`` alone (a byte per entry)."""

    @staticmethod
    def forward(ctx, x, keep, p, inplace):
        ctx.save_for_backward(keep)
        ctx.p = p
        noise = keep.to(x.dtype).div_(1 - p)  # as torch's dropout computes its noise
        if inplace:
            ctx.mark_dirty(x)
            return x.mul_(noise)
        return x * noise

    @staticmethod
    def backward(ctx, grad):
        (keep,) = ctx.saved_tensors
        return grad * keep.to(grad.dtype).div_(1 - ctx.p), None, None, None


def _alpha(x: torch.Tensor, keep: torch.Tensor, p: float, inplace: bool) -> torch.Tensor:
    """Alpha dropout of ``x`` with ``keep`` (broadcast), in the order torch computes it."""
    a = 1.0 / ((_ALPHA * _ALPHA * p + 1) * (1 - p)) ** 0.5
    noise = keep.to(x.dtype)
    b = noise.add(-1).mul_(_ALPHA * a).add_(_ALPHA * a * p)
    noise.mul_(a)
    return x.mul_(noise).add_(b) if inplace else x * noise + b


def _keep(place: stream.Place, name: str, x: torch.Tensor, p: float, per: str) -> torch.Tensor:
    """The keep mask of ``x``'s rows at ``place``, ``per`` element, channel or sample."""
    key, rows = place.draw(name), (place.first_row, x.shape[0])
    if per == "sample":  # a word per sample: no columns to hash
        return (row_words(key, rows, x.device) >= threshold(p)).view(
            (x.shape[0],) + (1,) * (x.dim() - 1))
    if per == "element":
        shape, cols = x.shape, x[0].numel() if x.shape[0] else 0
    else:
        shape, cols = (x.shape[0], x.shape[1]) + (1,) * (x.dim() - 2), x.shape[1]
    return (words(key, rows, (place.first_col, cols), x.device) >= threshold(p)).view(shape)


class _KeyedMixin:
    """What the keyed layers share: their name in the model and the keyed forward."""

    #: the layer's qualified name in the model (set by :func:`keyed_dropout`): its key
    key_name: str | None = None
    _per = "element"
    _alpha = False

    def forward(self, x):
        return self._keyed(x, super().forward)

    def _keyed(self, x: torch.Tensor, torch_forward):
        if torch.compiler.is_compiling():  # traced: the draw runs eagerly (see _eager)
            return _eager()(self, x, torch_forward)
        return self._draw(x, torch_forward)

    def _draw(self, x: torch.Tensor, torch_forward):
        place = stream.current()
        lowest = 2 if self._per == "channel" else 1  # a batch of samples (of channels)
        if not self.training or place is None or self.p in (0.0, 1.0) or x.dim() < lowest:
            return torch_forward(x)
        if self.key_name is None:  # a bug of the caller, never a user's mistake
            raise RuntimeError(f"{type(self).__name__} draws in a keyed stream but has no "
                               f"name: convert the model with keyed_dropout() after adding it")
        keep = _keep(place, self.key_name, x, self.p, self._per)
        if self._alpha:
            return _alpha(x, keep, self.p, self.inplace)
        return _Scaled.apply(x, keep, self.p, self.inplace)


_EAGER: list = []  # not functools.cache: dynamo warns of a cache wrapper it traces through


def _eager():
    """The keyed draw out of ``torch.compile``'s reach (its keys, new at every step, would be
    constants in a graph); made at the first compiled call, as ``disable`` imports dynamo."""
    if not _EAGER:
        _EAGER.append(torch.compiler.disable(_KeyedMixin._draw))
    return _EAGER[0]


class KeyedDropout(_KeyedMixin, nn.Dropout):
    """``nn.Dropout`` with each sample's mask keyed by its index in the global batch."""


class KeyedAlphaDropout(_KeyedMixin, nn.AlphaDropout):
    """``nn.AlphaDropout`` keyed by sample."""

    _alpha = True


class KeyedFeatureAlphaDropout(_KeyedMixin, nn.FeatureAlphaDropout):
    """``nn.FeatureAlphaDropout`` keyed by sample: whole channels (dimension 1)."""

    _alpha, _per = True, "channel"


class _Channels(_KeyedMixin):
    """Channel dropout; an input of ``unbatched`` dimensions is one sample (as torch's)."""

    _per = "channel"
    unbatched: tuple[int, ...] = ()

    def forward(self, x):
        torch_forward = super(_KeyedMixin, self).forward  # torch's layer's, past the mixin's
        if x.dim() not in self.unbatched:
            return self._keyed(x, torch_forward)
        return self._keyed(x.unsqueeze(0), torch_forward).squeeze(0)


class KeyedDropout1d(_Channels, nn.Dropout1d):
    """``nn.Dropout1d`` keyed by sample: ``(N, C, L)``, whole channels."""

    unbatched = (2,)


class KeyedDropout2d(_Channels, nn.Dropout2d):
    """``nn.Dropout2d`` keyed by sample: whole channels (a 3-D input is ``(N, C, L)``)."""


class KeyedDropout3d(_Channels, nn.Dropout3d):
    """``nn.Dropout3d`` keyed by sample: ``(N, C, D, H, W)``, whole channels."""

    unbatched = (1, 2, 3, 4)


class DropPath(_KeyedMixin, nn.Module):
    """Stochastic depth (Huang et al. 2016): each sample's branch dropped with probability
    ``p``, kept ones scaled by ``1/(1-p)`` (timm's ``DropPath``)."""

    _per = "sample"
    inplace = False

    def __init__(self, p: float = 0.0):
        super().__init__()
        self.p = float(p)

    def forward(self, x):
        return self._keyed(x, self._torch_draw)

    def _torch_draw(self, x):
        if not self.training or self.p == 0.0:
            return x
        keep = torch.empty((x.shape[0],) + (1,) * (x.dim() - 1), device=x.device)
        keep = keep.bernoulli_(1 - self.p).to(torch.bool)
        return x * 0.0 if self.p == 1.0 else _Scaled.apply(x, keep, self.p, False)

    def extra_repr(self) -> str:
        return f"p={self.p}"


#: torch's dropout layers and their keyed counterparts (exact types: a subclass of torch's
#: may change its forward, and is left alone)
KEYED_LAYERS = {nn.Dropout: KeyedDropout, nn.Dropout1d: KeyedDropout1d,
                nn.Dropout2d: KeyedDropout2d, nn.Dropout3d: KeyedDropout3d,
                nn.AlphaDropout: KeyedAlphaDropout,
                nn.FeatureAlphaDropout: KeyedFeatureAlphaDropout}


def _converted(module: nn.Module) -> nn.Module:
    keyed = KEYED_LAYERS[type(module)](module.p, module.inplace)
    keyed.train(module.training)
    return keyed


def keyed_dropout(model: nn.Module) -> nn.Module:
    """``model`` with its torch dropout layers replaced by keyed ones, in place (a new model
    when it is one), and every keyed layer named by its qualified name, its key."""
    if type(model) in KEYED_LAYERS:
        model = _converted(model)
    done: dict[int, nn.Module] = {}
    for parent in list(model.modules()):
        for child_name, child in list(parent._modules.items()):
            if type(child) in KEYED_LAYERS:  # a layer in two places stays one
                parent._modules[child_name] = done.setdefault(id(child), _converted(child))
    for name, module in model.named_modules():
        if isinstance(module, _KeyedMixin):
            module.key_name = name
    return model


def drop_path_rates(rate: float, blocks: int) -> list[float]:
    """Each block's drop-path probability, linear from 0 at the first to ``rate`` (timm's)."""
    if blocks <= 1:
        return [rate] * blocks
    return [rate * i / (blocks - 1) for i in range(blocks)]
