"""tandem.state_keys against the plain model's own state dict: keys, order, ``_metadata``, values."""

import pickle

import pytest
import torch
from torch import nn

from tandem.parallel import DataParallel
from tandem.state_keys import register_plain_keys, replace_prefix, strip_prefix
from tandem.strategies.compile import compiled


def _model(seed: int = 0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 2))


class Holder(nn.Module):
    """A wrapper that keeps the model in ``self.inner`` (like DataParallel's ``module``)."""

    def __init__(self, inner: nn.Module, plain: bool = True):
        super().__init__()
        self.inner = inner
        if plain:
            register_plain_keys(self, "inner")


def _same_state(got: dict, want: dict):
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert dict(got._metadata) == dict(want._metadata)


def test_strip_prefix_drops_it_from_keys_and_metadata_and_leaves_the_input_alone():
    model = _model()
    wrapped = Holder(model, plain=False).state_dict()
    assert list(wrapped._metadata) == ["", "inner", "inner.0", "inner.1", "inner.2", "inner.3"]
    before = (list(wrapped), list(wrapped._metadata))
    _same_state(strip_prefix(wrapped, "inner."), model.state_dict())
    assert (list(wrapped), list(wrapped._metadata)) == before
    plain = {"a.weight": 1, "inner.b": 2}  # no _metadata; keys without the prefix are kept
    assert strip_prefix(plain, "inner.") == {"a.weight": 1, "b": 2}
    assert list(strip_prefix(plain, "inner.")) == ["a.weight", "b"]


def test_nested_prefixes_come_off_one_at_a_time_and_only_in_front():
    state = {"module.module.a": 1, "module.b.module.c": 2}
    assert list(strip_prefix(state, "module.")) == ["module.a", "b.module.c"]
    assert list(strip_prefix(strip_prefix(state, "module."), "module.")) == ["a", "b.module.c"]
    assert list(replace_prefix(state, "module.b.module.", "module.b.")) == [
        "module.module.a", "module.b.c"]
    assert strip_prefix({"modulex.a": 1}, "module.") == {"modulex.a": 1}  # whole components


def test_a_registered_wrapper_saves_plain_keys_and_loads_either_form():
    model = _model()
    holder = Holder(model)
    _same_state(holder.state_dict(), model.state_dict())
    outer = nn.ModuleDict({"net": Holder(_model())})  # hooks at a non-empty prefix
    assert list(outer.state_dict()) == ["net." + k for k in model.state_dict()]
    for state in (model.state_dict(), Holder(model, plain=False).state_dict()):
        fresh = Holder(_model(seed=1))
        metadata = dict(state._metadata)
        fresh.load_state_dict(state)
        assert dict(state._metadata) == metadata  # the caller's dict is not renamed
        _same_state(fresh.inner.state_dict(), model.state_dict())
    pickle.loads(pickle.dumps(holder))  # its hooks pickle


@pytest.mark.parametrize("order", ["compiled inside DataParallel", "DataParallel inside compiled"])
def test_compiled_and_data_parallel_wrapped_state_dict_round_trip(order):
    """Two wrappers, two prefixes (``module.``, ``_orig_mod.``): plain keys out, plain keys in.
    Nothing is run, so nothing compiles (torch.compile is lazy)."""
    def wrap(model):
        if order == "compiled inside DataParallel":
            return DataParallel(compiled(model), ["cpu"] * 2)
        return compiled(DataParallel(model, ["cpu"] * 2))

    model = _model()
    state = wrap(model).state_dict()
    _same_state(state, model.state_dict())
    other = _model(seed=1)
    target = wrap(other)
    target.load_state_dict(state)
    _same_state(other.state_dict(), model.state_dict())
    plain = _model(seed=2)
    plain.load_state_dict(target.state_dict())  # strict, into an unwrapped model
    _same_state(plain.state_dict(), model.state_dict())


def test_strip_wrappers_front_only_leaves_a_models_own_module_paths():
    """nested=False (a model's own state, model_state) strips only what every key starts with;
    the reader of others' files (nested=True) also strips a wrapped submodule's path."""
    from tandem.state_keys import strip_wrappers

    alexnet = {"features.module.0.weight": 1, "classifier.1.weight": 2}
    assert strip_wrappers(alexnet, nested=False) is alexnet
    assert list(strip_wrappers(alexnet)) == ["features.0.weight", "classifier.1.weight"]
    partly = {"module.module.a": 1, "b": 2}  # not every key is wrapped at the front
    assert list(strip_wrappers(partly, nested=False)) == ["module.module.a", "b"]
    assert list(strip_wrappers(partly)) == ["module.a", "b"]
    twice = {"module.module.a": 1, "module.module.b": 2}
    assert list(strip_wrappers(twice, nested=False)) == ["a", "b"] == list(strip_wrappers(twice))
    assert strip_wrappers({}, nested=False) == {}
