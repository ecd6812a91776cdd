"""PlainNorms and the strategies' plain norms against the plain model's own norms: a layer's
shards summed (hybrid on 3 CPU shards), blocks spread over processes reduced once, tensors
every process holds whole never summed; gradient clipping against torch's clip_grad_norm_ on
the plain model."""

import copy

import pytest
import torch
from strategy_steps import Tiny
from torch import nn

from tandem.hybrid import ColumnParallelLinear
from tandem.optim import GradClip
from tandem.plain_norms import PlainNorms
from tandem.strategies import create_strategy

CPU3 = [torch.device("cpu")] * 3


def plain_squares(model: nn.Module, of) -> list[float]:
    return [float(of(p).double().pow(2).sum()) for p in model.parameters()]


def test_pieces_sum_into_their_plain_parameter_and_none_counts_zero():
    a, b, c = torch.ones(2, 3), torch.full((1, 3), 2.0), torch.tensor([3.0])
    norms = PlainNorms([a, b, c], [0, 0, 1])
    (squares,) = norms.squares([a, b, c], [a, b, None])
    assert [float(s) for s in squares] == [18.0, 18.0, 0.0]  # 6 + 12 for both blocks
    assert float(norms.total([a, b, c], [a, b, c])) == 27.0  # each plain parameter once


def test_only_the_spread_parameters_go_through_the_reduce_once_per_call():
    a, b = torch.ones(4), torch.ones(2)
    calls = []

    def doubled(t):  # as if another process held an equal block
        calls.append(t.shape)
        return t * 2

    norms = PlainNorms([a, b], spread=[1], reduce=doubled)
    first, second = norms.squares([a, b], [a, b], [2 * a, 2 * b])
    assert [float(s) for s in first] == [4.0, 4.0]  # a whole everywhere: counted once
    assert [float(s) for s in second] == [16.0, 16.0]
    assert calls == [torch.Size([2, 1])]  # both lists in one collective


def test_hybrid_gives_each_layer_its_whole_norm_and_the_other_strategies_their_parameters():
    torch.manual_seed(0)
    model = Tiny().double()
    x, y = torch.randn(7, 3, 8, 8, dtype=torch.float64), torch.randint(0, 5, (7,))
    reference = copy.deepcopy(model)
    nn.functional.cross_entropy(reference(x), y).backward()
    want_w = plain_squares(reference, lambda p: p.detach())
    want_g = plain_squares(reference, lambda p: p.grad)
    for name in ("hybrid", "dp"):
        strategy = create_strategy(name, CPU3, sync_bn=True)
        wrapped = strategy.setup(copy.deepcopy(model))
        nn.functional.cross_entropy(wrapped(x), y).backward()
        norms = strategy.plain_norms(wrapped)
        params = list(wrapped.parameters())
        weights, grads = norms.squares(params, params, [p.grad for p in params])
        plain = {round(float(w), 12) for w in weights}
        assert plain == {round(w, 12) for w in want_w}, name  # each value a plain layer's
        assert float(norms.total(params, [p.grad for p in params])) == pytest.approx(
            sum(want_g), rel=1e-12)
        if name == "hybrid":  # the classifier's shards: more tensors than plain parameters
            assert len(params) > len(want_w)
            per_shard = PlainNorms(params).squares(params, params)[0]
            assert {round(float(w), 12) for w in per_shard} != plain  # the negative control


def test_clip_by_norm_matches_torch_on_the_plain_model_under_hybrid():
    torch.manual_seed(0)
    model = Tiny().double()
    x, y = torch.randn(7, 3, 8, 8, dtype=torch.float64), torch.randint(0, 5, (7,))
    reference = copy.deepcopy(model)
    nn.functional.cross_entropy(reference(x), y).backward()
    total = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01)
    strategy = create_strategy("hybrid", CPU3, sync_bn=True)
    wrapped = strategy.setup(copy.deepcopy(model))
    nn.functional.cross_entropy(wrapped(x), y).backward()
    clip = GradClip(0.01, "norm", strategy.plain_norms(wrapped))
    assert float(clip()) == pytest.approx(float(total), rel=1e-12)
    assert float(total) > 0.01  # it bit
    for p, (name, q) in zip(wrapped.trunk.module.parameters(), reference.named_parameters()):
        assert (p.grad - q.grad).abs().max() < 1e-15, name
    column = next(m for m in wrapped.head if isinstance(m, ColumnParallelLinear))
    want = dict(reference.named_parameters())["classifier.0.weight"].grad
    assert (torch.cat([s.weight.grad for s in column.shards]) - want).abs().max() < 1e-15
    assert clip.fields() == {"clipped_steps": 1} and clip.fields() == {"clipped_steps": 0}


def test_clip_by_value_clamps_each_element():
    p = torch.zeros(4, requires_grad=True)
    p.grad = torch.tensor([-3.0, 0.5, 2.0, -0.1])
    clip = GradClip(1.0, "value", PlainNorms([p]))
    assert float(clip()) == 3.0
    assert p.grad.tolist() == [-1.0, 0.5, 1.0, pytest.approx(-0.1)]
