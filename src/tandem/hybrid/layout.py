"""How ``HybridParallel`` finds and splits a classifier.

The head is the attribute named by ``head=`` (``--hybrid-head``), else the first of
:data:`HEADS` the model has: an ``nn.Linear`` or an ``nn.Sequential`` holding one. Left to
right: leading elementwise layers (:data:`ELEMENTWISE`) join the data-parallel trunk;
``Linear, elementwise..., Linear`` becomes a Column/Row pair; any other ``Linear`` a gathered
Column; anything else runs on the output device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn
from tandem.errors import UsageError, a
from tandem.keyed import KeyedAlphaDropout, KeyedDropout

#: Attributes looked for, in order, when no head is named: torchvision's AlexNet/VGG, ResNet.
HEADS = ("classifier", "fc")

#: Layers that act on each element alone and hold no parameters or buffers.
ELEMENTWISE = (nn.Identity, nn.Dropout, nn.AlphaDropout, KeyedDropout, KeyedAlphaDropout,
               nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU,
               nn.Mish, nn.Tanh, nn.Sigmoid, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid,
               nn.Softplus)


def is_elementwise(module: nn.Module) -> bool:
    """True for a stateless, per-element layer (it may run on a slice of the features)."""
    return (type(module) in ELEMENTWISE and not any(True for _ in module.parameters())
            and not any(True for _ in module.buffers()))


@dataclass
class Stage:
    """One step of the split classifier, ``indices`` its positions: ``"pair"`` (``indices[0]``
    column, ``indices[1:-1]`` elementwise per shard, ``indices[-1]`` row), ``"column"`` (one
    Linear, gathered) or ``"local"`` (one module run whole on the output device)."""

    kind: str
    indices: list[int] = field(default_factory=list)


def classifier_layout(classifier: nn.Module) -> tuple[list[int], list[Stage]]:
    """``(leading, stages)``: indices that join the trunk, then the head's stages in order; an
    error unless ``classifier`` is an ``nn.Sequential`` (its layers are split one by one)."""
    if not isinstance(classifier, nn.Sequential):
        raise UsageError(f"HybridParallel needs model.classifier to be an nn.Sequential, got "
                         f"{type(classifier).__name__}")
    mods = list(classifier)
    i = 0
    while i < len(mods) and is_elementwise(mods[i]):
        i += 1
    leading = list(range(i))
    stages: list[Stage] = []
    while i < len(mods):
        if isinstance(mods[i], nn.Linear):
            j = i + 1
            while j < len(mods) and is_elementwise(mods[j]):
                j += 1
            if j < len(mods) and isinstance(mods[j], nn.Linear):
                stages.append(Stage("pair", list(range(i, j + 1))))
                i = j + 1
                continue
            stages.append(Stage("column", [i]))
        else:
            stages.append(Stage("local", [i]))
        i += 1
    return leading, stages


def _splittable(module) -> str | None:
    """Why ``module`` cannot be split as a head (``None``: it can)."""
    if isinstance(module, nn.Linear):
        return None
    if isinstance(module, nn.Sequential):
        if any(isinstance(m, nn.Linear) for m in module):
            return None
        return "an nn.Sequential without an nn.Linear"
    return a(type(module).__name__) if isinstance(module, nn.Module) else (
        f"{a(type(module).__name__)}, not a module")


def head_problem(model: nn.Module, head: str | None = None) -> str | None:
    """``None`` if ``model`` has a head to split, else what was looked for and what was found."""
    names = (head,) if head else HEADS
    looked = " or ".join(f".{n}" for n in names)
    found = [n for n in names if hasattr(model, n)]
    if not found:
        children = ", ".join(n for n, _ in model.named_children()) or "none"
        hint = "" if head else "; name yours with hybrid_head= (--hybrid-head)"
        return (f"needs a Linear head to split: looked for {looked} on {type(model).__name__} "
                f"and found no such attribute (its children: {children}){hint}")
    why = _splittable(getattr(model, found[0]))
    if why is None:
        return None
    return (f"needs a Linear head to split: looked for {looked} on {type(model).__name__} and "
            f"found .{found[0]}, {why}; it must be an nn.Linear or an nn.Sequential holding one")


def find_head(model: nn.Module, head: str | None = None, who: str = "HybridParallel") -> str:
    """The attribute holding ``model``'s head; else :func:`head_problem`'s error, as ``who``."""
    problem = head_problem(model, head)
    if problem is not None:
        raise UsageError(f"{who} {problem}")
    return head or next(n for n in HEADS if hasattr(model, n))


def head_sequential(module: nn.Module) -> nn.Sequential:
    """The head as an ``nn.Sequential`` (a bare ``Linear`` becomes a sequence of one)."""
    return module if isinstance(module, nn.Sequential) else nn.Sequential(module)
