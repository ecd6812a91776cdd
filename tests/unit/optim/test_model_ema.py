"""ModelEma against torch's AveragedModel (without warm-up) and against timm's warm-up formula
computed by hand; the average under hybrid against the plain model's, in the plain layout; the
swap that lends the average to the model for a validation or a save."""

import copy

import pytest
import torch
from strategy_steps import Tiny
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from tandem.optim import ModelEma, ema_decay
from tandem.strategies import create_strategy


def _steps(model, count, seed=1):
    """``count`` SGD steps on random batches (BatchNorm's running stats move too)."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(count):
        x = torch.randn(6, 3, 8, 8, generator=g, dtype=torch.float64)
        y = torch.randint(0, 5, (6,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        yield


def test_the_decay_warms_up_as_timms_model_ema_v3():
    assert ema_decay(0.9999, 0) == 0.0  # the first update copies
    assert ema_decay(0.9999, 1) == pytest.approx(1 - 2 ** (-2 / 3))
    assert ema_decay(0.9999, 10) == pytest.approx(1 - 11 ** (-2 / 3))
    assert ema_decay(0.9, 10 ** 6) == 0.9  # capped at the decay asked for
    assert ema_decay(0.9999, 5, warmup=False) == 0.9999


def test_without_warm_up_it_is_torchs_averaged_model_with_its_ema_helper():
    torch.manual_seed(0)
    model = Tiny().double().train()
    ema = ModelEma(model, 0.8, warmup=False)
    torch_ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.8), use_buffers=True)
    for _ in _steps(model, 4):
        ema.update()
        torch_ema.update_parameters(model)
    theirs = [*torch_ema.module.parameters(), *torch_ema.module.buffers()]
    for mine, their in zip(ema.shadow, theirs):
        if mine.is_floating_point():
            assert torch.equal(mine, their)
        else:  # num_batches_tracked: copied (torch's averages an integer and truncates it)
            assert int(mine) == 4


def test_with_warm_up_each_update_uses_the_formulas_decay():
    torch.manual_seed(0)
    model = Tiny().double().train()
    ema = ModelEma(model, 0.9)
    hand = [p.detach().clone() for p in model.parameters()]
    for n, _ in enumerate(_steps(model, 5)):
        ema.update()
        d = 0.0 if n == 0 else min(0.9, 1 - (1 + n) ** (-2 / 3))
        hand = [d * h + (1 - d) * p.detach() for h, p in zip(hand, model.parameters())]
    for mine, want in zip(ema.shadow, hand):
        assert (mine - want).abs().max() < 1e-15
    assert ema.updates == 5


def test_swapped_lends_the_average_to_the_model_and_gives_it_back():
    torch.manual_seed(0)
    model = Tiny().double()
    ema = ModelEma(model, 0.5)
    for _ in _steps(model, 3):
        ema.update()
    own = copy.deepcopy(model.state_dict())
    average = [s.clone() for s in ema.shadow]
    with pytest.raises(RuntimeError), ema.swapped():
        assert all(torch.equal(t, a) for t, a in zip([*model.parameters(), *model.buffers()],
                                                     average))
        raise RuntimeError("the block failed")
    assert all(torch.equal(v, own[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(s, a) for s, a in zip(ema.shadow, average))


def test_under_hybrid_the_average_is_the_plain_models_and_loads_back_in_the_plain_layout():
    torch.manual_seed(0)
    plain = Tiny().double()
    strategy = create_strategy("hybrid", [torch.device("cpu")] * 3, sync_bn=True)
    wrapped = strategy.setup(copy.deepcopy(plain))
    emas = ModelEma(plain, 0.7), ModelEma(wrapped, 0.7)
    for _ in zip(_steps(plain, 3), _steps(wrapped, 3)):
        for ema in emas:
            ema.update()
    want = emas[0].state_dict(plain.state_dict)
    got = emas[1].state_dict(lambda: strategy.state_dict(wrapped))
    assert want.keys() == got.keys() and got["updates"] == 3
    for key, value in want["state_dict"].items():
        assert (got["state_dict"][key].double() - value.double()).abs().max() < 1e-12, key
    # loaded into a fresh hybrid's average, through the strategy: the same plain state back
    other = strategy.setup(copy.deepcopy(plain))
    own = {k: v.clone() for k, v in strategy.state_dict(other).items()}
    fresh = ModelEma(other, 0.7)
    fresh.load_state_dict(got, lambda state: strategy.load_state_dict(other, state))
    again = fresh.state_dict(lambda: strategy.state_dict(other))
    assert fresh.updates == 3
    assert all(torch.equal(again["state_dict"][k], v) for k, v in got["state_dict"].items())
    # and the model itself kept its own weights
    assert all(torch.equal(v, own[k]) for k, v in strategy.state_dict(other).items())
