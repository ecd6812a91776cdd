"""A wrapper's prefix in state-dict keys (``module.``, ``_orig_mod.``): dropped on save, put back
on load, stripped from what others saved. Unlike torch's
``consume_prefix_in_state_dict_if_present`` these copy and keep the order, ``_metadata``
included. Prefixes end with a dot.
"""

from __future__ import annotations

from collections import OrderedDict
from functools import partial

WRAPPER = "module."  # DataParallel / DistributedDataParallel keep the model in ``.module``


def _moved(key, old: str, new: str):
    """``key`` with ``old`` in front replaced by ``new`` (``old`` less its dot, a ``_metadata``
    module path, becomes ``new`` less its dot)."""
    if not isinstance(key, str):
        return key
    if key + "." == old:
        return new[:-1]
    return new + key[len(old):] if key.startswith(old) else key


def _rename(mapping: dict, old: str, new: str) -> None:
    """In place, keeping the order; where two keys meet, the later one's value wins."""
    items = [(_moved(k, old, new), v) for k, v in mapping.items()]
    mapping.clear()
    mapping.update(items)


def _rename_state(state: dict, old: str, new: str) -> None:
    _rename(state, old, new)
    metadata = getattr(state, "_metadata", None)
    if metadata is not None:  # module versions, by module path (read by load_state_dict)
        _rename(metadata, old, new)


def replace_prefix(state: dict, old: str, new: str) -> dict:
    """A copy of ``state`` (``_metadata`` too) with ``old`` in front of keys replaced by ``new``."""
    out = OrderedDict(state)
    if getattr(state, "_metadata", None) is not None:
        out._metadata = OrderedDict(state._metadata)
    _rename_state(out, old, new)
    return out


def strip_prefix(state: dict, prefix: str) -> dict:
    """A copy of ``state`` without ``prefix`` in front of the keys that have it (others kept)."""
    return replace_prefix(state, prefix, "")


def strip_wrappers(state: dict, *, nested: bool = True) -> dict:
    """``state`` without the :data:`WRAPPER` components DataParallel/DDP put in its keys (a copy
    when any is dropped). ``P.module.`` is one only when *every* key under ``P.`` goes through
    it; ``nested=False`` strips only at the front (a model's own deeper ``module`` stays)."""
    if not nested:
        while state and all(isinstance(k, str) and k.startswith(WRAPPER) for k in state):
            state = strip_prefix(state, WRAPPER)
        return state
    keys = list(state)
    if not all(isinstance(k, str) for k in keys):
        return state
    paths = {k[:i] for k in keys for i in range(len(k))  # each P where some key goes on P.module.
             if k.startswith(WRAPPER, i) and (i == 0 or k[i - 1] == ".")}
    wrapped = [p for p in paths if all(k.startswith(p + WRAPPER) for k in keys if k.startswith(p))]
    renamed = state
    for path in sorted(wrapped, key=len, reverse=True):  # inner first: outer paths stay put
        renamed = replace_prefix(renamed, path + WRAPPER, path)
    return renamed if len(renamed) == len(state) else state


def _save_plain(inner: str, module, state_dict, prefix, local_metadata) -> None:
    """state_dict post-hook: ``<prefix><inner>x`` -> ``<prefix>x`` (keys and metadata)."""
    _rename_state(state_dict, prefix + inner, prefix)


def _load_plain(inner: str, module, state_dict, prefix, *args) -> None:
    """load_state_dict pre-hook: accept ``<prefix>x`` for ``<prefix><inner>x`` (keys alone)."""
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(prefix + inner)]:
        state_dict[prefix + inner + key[len(prefix):]] = state_dict.pop(key)


def register_plain_keys(module, attribute: str) -> None:
    """Make ``module``, which wraps a model in ``module.<attribute>``, save the wrapped model's
    keys and load them as well as its own prefixed ones."""
    inner = attribute + "."
    # partials of module-level functions, so a wrapper with these hooks still pickles
    module.register_state_dict_post_hook(partial(_save_plain, inner))
    module.register_load_state_dict_pre_hook(partial(_load_plain, inner))
