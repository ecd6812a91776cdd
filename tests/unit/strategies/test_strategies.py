"""Every strategy computes the same update as `single`, in process, against a tiny model.

For ``dp``, ``balanced`` and ``hybrid`` over 1, 2 and 3 CPU replicas, with SyncBatchNorm
(``sync_bn=True``), uneven chunks (7 samples) and a batch smaller than the device count (2 on
3): the loss, top-1 count, parameters and batch-norm buffers after two SGD steps with momentum
equal `single`'s, and so does the evaluation-mode step.
"""

import copy
import warnings

import pytest
import torch
from strategy_steps import Tiny, make_batches, run_steps
from torch import nn

from tandem.strategies import create_strategy, strategy_names

CPU = torch.device("cpu")


def chunks_per_forward(model: nn.Module, replicas: int, batch: int) -> list:
    """Record the chunk each replica's copy of ``model.features`` receives; ``check()`` then
    asserts every forward was split over ``min(replicas, batch)`` replicas, covering the batch."""
    seen = []
    model.features[0].register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[0]))
    k = min(replicas, batch)

    def check():
        steps = [seen[i:i + k] for i in range(0, len(seen), k)]
        assert len(steps) == 3 and all(len(s) == k and sum(s) == batch for s in steps), seen
    return check


def test_registry_has_every_strategy():
    assert {"single", "dp", "balanced", "hybrid", "ddp"} <= set(strategy_names())


@pytest.mark.parametrize("name", ["dp", "balanced", "hybrid"])
@pytest.mark.parametrize("replicas", [1, 2, 3])
@pytest.mark.parametrize("batch", [7, 2])
def test_strategy_equals_single(name, replicas, batch):
    torch.manual_seed(0)
    model = Tiny()
    batches = make_batches(batch)
    ref_outs, ref_state = run_steps(create_strategy("single", [CPU]), copy.deepcopy(model),
                                    batches)
    strategy = create_strategy(name, [CPU] * replicas, sync_bn=True)
    check_chunks = chunks_per_forward(model, replicas, batch)
    outs, state = run_steps(strategy, model, batches)
    check_chunks()  # the replicas shared each batch (two steps and the evaluation)
    for (loss, correct, count), (ref_loss, ref_correct, ref_count) in zip(outs, ref_outs):
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
        assert (correct, count) == (ref_correct, ref_count)
    assert state.keys() == ref_state.keys()
    for key in ref_state:
        assert torch.allclose(state[key].float(), ref_state[key].float(), atol=1e-5), key


@pytest.mark.parametrize("name", ["dp", "balanced", "hybrid"])
@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("batch", [7, 2])
def test_strategy_equals_single_in_float64(name, replicas, batch):
    """The float64 twin of the test above, at 1e-12; its noise-floor control: float32 single
    is within 1e-6 of float64 single, so this config barely amplifies rounding and the
    float32 tolerance above (1e-5) cannot be reached by rounding alone."""
    torch.manual_seed(0)
    model = Tiny()
    batches = make_batches(batch)
    _, ref32 = run_steps(create_strategy("single", [CPU]), copy.deepcopy(model), batches)
    batches = [(x.double(), y) for x, y in batches]
    model = model.double()
    _, ref = run_steps(create_strategy("single", [CPU]), copy.deepcopy(model), batches)
    check_chunks = chunks_per_forward(model, replicas, batch)
    _, state = run_steps(create_strategy(name, [CPU] * replicas, sync_bn=True), model, batches)
    check_chunks()
    for key in ref:
        if ref[key].is_floating_point():
            assert (ref32[key].double() - ref[key]).abs().max() < 1e-6, key  # noise floor
            assert (state[key] - ref[key]).abs().max() < 1e-12, key


def test_dp_without_sync_bn_differs_so_the_test_above_can_fail():
    torch.manual_seed(0)
    model = Tiny()
    batches = make_batches(7)
    _, ref = run_steps(create_strategy("single", [CPU]), copy.deepcopy(model), batches)
    _, got = run_steps(create_strategy("dp", [CPU] * 2), model, batches)
    assert not torch.allclose(got["features.0.weight"], ref["features.0.weight"], atol=1e-5)


def test_single_uses_the_first_device_and_warns():
    with pytest.warns(UserWarning, match="uses only cpu"):
        s = create_strategy("single", [CPU, CPU])
    assert s.devices == [CPU] and s.is_main and s.world_size == 1


def test_sync_bn_with_single_is_harmless():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = create_strategy("single", [CPU], sync_bn=True)
    model = Tiny()
    assert s.setup(model) is model


def test_hybrid_refuses_a_model_without_a_linear_head():
    strategy = create_strategy("hybrid", [CPU] * 2)
    headless = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    with pytest.raises(ValueError, match=r"looked for .classifier or .fc on Sequential"):
        strategy.setup(headless)


def test_unknown_strategy_lists_the_valid_ones():
    with pytest.raises(ValueError, match="single"):
        create_strategy("pipeline", [CPU])
