"""`hybrid` on a user's net (a Linear `.fc`, a head named with hybrid_head=) against `single`.

Float64 models, SyncBatchNorm, uneven chunks: losses, weights and buffers after two SGD steps
equal the single-device run's; the plain state dict has the plain model's keys; check_model's
messages name the attribute looked for and what was found.
"""

import copy

import pytest
import torch
from torch import nn

from tandem.hybrid import HybridParallel, plan
from tandem.strategies import create_strategy, strategy_class

CPU = torch.device("cpu")


class FcNet(nn.Module):
    """ResNet's shape: convs, pool, flatten, then a Linear ``fc`` (no features/classifier)."""

    def __init__(self, classes=5):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.fc = nn.Linear(24, classes)

    def forward(self, x):
        x = self.pool(torch.relu(self.bn(self.conv(x))))
        return self.fc(torch.flatten(x, 1))


class HeadNet(nn.Module):
    """A backbone and an MLP called ``head``, which hybrid splits as a column/row pair."""

    def __init__(self, classes=5):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(2), nn.Flatten())
        self.head = nn.Sequential(nn.Dropout(0.0), nn.Linear(16, 12), nn.ReLU(),
                                  nn.Linear(12, classes))

    def forward(self, x):
        return self.head(self.body(x))


def _steps(strategy, model, batches):
    wrapped = strategy.setup(model)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    wrapped.train()
    losses = []
    for x, y in batches:
        out = strategy.forward_loss(wrapped, criterion, x, y)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        losses.append(out.loss.item())
    return losses, strategy.state_dict(wrapped)


def _batches(n=7):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(n, 3, 6, 6, generator=g, dtype=torch.float64),
             torch.randint(0, 5, (n,), generator=g)) for _ in range(2)]


@pytest.mark.parametrize("make, head", [(FcNet, None), (HeadNet, "head")])
@pytest.mark.parametrize("replicas", [2, 3])
def test_hybrid_trains_a_user_net_like_single(make, head, replicas):
    torch.manual_seed(0)
    model = make().double()
    batches = _batches()
    ref_losses, ref_state = _steps(create_strategy("single", [CPU]), copy.deepcopy(model),
                                   batches)
    strategy = create_strategy("hybrid", [CPU] * replicas, sync_bn=True,
                               options={"hybrid_head": head})
    assert strategy.check_model(model, **strategy.options) is None
    losses, state = _steps(strategy, model, batches)
    assert losses == pytest.approx(ref_losses, rel=1e-12, abs=1e-12)
    assert list(state) == list(ref_state)  # the plain model's keys, in its order
    for k in state:
        torch.testing.assert_close(state[k], ref_state[k], rtol=1e-10, atol=1e-12, msg=k)


def test_hybrid_splits_the_named_head_and_round_trips_its_state():
    torch.manual_seed(0)
    model = HeadNet()
    hybrid = HybridParallel(copy.deepcopy(model), ["cpu"] * 2, head="head")
    x = torch.randn(5, 3, 6, 6)
    model.eval(), hybrid.eval()
    torch.testing.assert_close(hybrid(x), model(x))
    other = HeadNet().state_dict()
    hybrid.load_plain_state_dict(other)
    for k, v in hybrid.plain_state_dict().items():
        torch.testing.assert_close(v, other[k], msg=k)
    report = plan(model, 2, batch_size=8, input_size=(3, 6, 6), head="head")
    assert report.params_classifier == sum(p.numel() for p in model.head.parameters())
    assert any(row.startswith("head.1 Linear 16->12: column") for row in report.layout)


def test_check_model_names_what_it_looked_for_and_what_it_found():
    check = strategy_class("hybrid").check_model
    assert check(FcNet()) is None
    assert check(HeadNet(), "head") is None
    assert check(HeadNet()) == (
        "needs a Linear head to split: looked for .classifier or .fc on HeadNet and found no "
        "such attribute (its children: body, head); name yours with hybrid_head= "
        "(--hybrid-head)")
    assert check(HeadNet(), "top") == (
        "needs a Linear head to split: looked for .top on HeadNet and found no such attribute "
        "(its children: body, head)")
    conv_fc = FcNet()
    conv_fc.fc = nn.Conv2d(6, 5, 1)
    assert check(conv_fc) == (
        "needs a Linear head to split: looked for .classifier or .fc on FcNet and found .fc, "
        "a Conv2d; it must be an nn.Linear or an nn.Sequential holding one")
    assert "found .body, an nn.Sequential without an nn.Linear" in check(HeadNet(), "body")
    with pytest.raises(ValueError, match="looked for .classifier or .fc on HeadNet"):
        create_strategy("hybrid", [CPU] * 2).setup(HeadNet())


def test_a_head_that_is_not_the_last_call_is_refused():
    class Softmaxed(FcNet):
        def forward(self, x):
            return super().forward(x).softmax(1)

    with pytest.raises(ValueError, match=r"Softmaxed.forward does more after .fc"):
        HybridParallel(Softmaxed(), ["cpu"] * 2)(torch.randn(3, 3, 6, 6))
