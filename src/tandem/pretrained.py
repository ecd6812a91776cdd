"""``--pretrained FILE``: start a model from a torchvision state dict or any checkpoint (nothing
is downloaded). Only the final classifier may differ (in outputs): it then stays fresh.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from . import checkpoint
from .checkpoint import compat as checkpoint_compat
from .config import NO_WEIGHTS_FILE
from .errors import TandemError, param
from .model_state import load_plain_state_dict, plain_state_dict


class PretrainedError(TandemError, ValueError):
    """The weights file does not fit the model; the message names the file and the layer."""


def _shape(t) -> str:
    return "x".join(str(d) for d in t.shape) or "scalar"


def load_pretrained(model: nn.Module, path: str, arch: str = "the model", strategy=None) -> str:
    """Load the weights in ``path`` into ``model`` (with ``strategy``: what its ``setup``
    returned, loaded by it); return one line saying what loaded."""
    if Path(path).is_dir():
        raise PretrainedError(f"{param('pretrained')} '{path}' is a directory; {NO_WEIGHTS_FILE} "
                              f"(a data directory goes after the flags or in {param('data')})")
    state = checkpoint.load(path)["state_dict"]
    expected = strategy.state_dict(model) if strategy else plain_state_dict(model)
    head = checkpoint_compat.final_layer(expected)
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    if missing or unexpected:
        what = (f"{len(missing)} missing key(s) (e.g. {missing[0]})" if missing else
                f"{len(unexpected)} unexpected key(s) (e.g. {unexpected[0]})")
        raise PretrainedError(f"{param('pretrained')} '{path}' does not fit {param('arch')} "
                              f"{arch}: {what}")
    skipped = []
    for key, want in expected.items():
        have = state[key]
        if getattr(have, "shape", None) == getattr(want, "shape", None):
            continue
        if head and key.rsplit(".", 1)[0] == head[0]:
            skipped.append(key)
            continue
        raise PretrainedError(f"{param('pretrained')} '{path}' does not fit {param('arch')} "
                              f"{arch}: {key} is {_shape(have)} in the file but {_shape(want)} in "
                              "the model")
    merged = {k: (want if k in skipped else state[k]) for k, want in expected.items()}
    checkpoint.load_weights(model, merged, path,
                            strategy.load_state_dict if strategy else load_plain_state_dict)
    loaded = len(expected) - len(skipped)
    if not skipped:
        return f"pretrained: {loaded} tensors from '{path}'"
    classes = checkpoint_compat.final_layer(state)
    return (f"pretrained: {loaded} tensors from '{path}'; left out {', '.join(skipped)} "
            f"({classes[1] if classes else '?'} classes in the file, {head[1]} here: "
            f"re-initialised)")
