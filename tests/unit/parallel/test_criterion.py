"""DataParallelModel + DataParallelCriterion against one device running the whole batch."""

import copy

import pytest
import torch
from torch import nn

from tandem.parallel import DataParallelCriterion, DataParallelModel
from tandem.parallel.traffic import TrafficMeter

DEVICE_COUNTS = [1, 2, 3, 4]
BATCHES = [9, 7, 3]  # uneven and smaller than the device count


def _net(classes=5):
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, classes))


def _check(criterion, n, batch, targets_fn, transform=None, classes=5):
    """Loss, gradients and an SGD step equal the single-device ones."""
    model = _net(classes)
    reference = copy.deepcopy(model)
    wrapped = DataParallelModel(model, ["cpu"] * n)
    parallel_loss = DataParallelCriterion(criterion, ["cpu"] * n)
    x = torch.randn(batch, 6)
    targets = targets_fn(batch)
    transform = transform or (lambda t: t)

    outputs = wrapped(x)
    assert isinstance(outputs, list) and len(outputs) == min(n, batch)
    loss = parallel_loss([transform(o) for o in outputs], *targets)
    ref_loss = criterion(transform(reference(x)), *targets)
    assert loss.dim() == ref_loss.dim()
    torch.testing.assert_close(loss, ref_loss)
    loss.sum().backward()
    ref_loss.sum().backward()
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, r.grad)
    for params in (model.parameters(), reference.parameters()):
        torch.optim.SGD(params, lr=0.3).step()
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, r)


def _classes(batch, ignore_first=0):
    t = torch.randint(0, 5, (batch,))
    t[:ignore_first] = -100
    return (t,)


@pytest.mark.parametrize("n", DEVICE_COUNTS)
@pytest.mark.parametrize("batch", BATCHES)
def test_cross_entropy_weight_ignore_index_label_smoothing(n, batch):
    criterion = nn.CrossEntropyLoss(weight=torch.rand(5) + 0.1, ignore_index=-100,
                                    label_smoothing=0.2)
    # the first targets are ignored: with several replicas, chunk 0 is entirely ignored
    _check(criterion, n, batch, lambda b: _classes(b, ignore_first=min(3, b - 1)))


@pytest.mark.parametrize("n", DEVICE_COUNTS)
@pytest.mark.parametrize("criterion", [
    nn.CrossEntropyLoss(),
    nn.CrossEntropyLoss(label_smoothing=0.1),
    nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 0.5, 3.0, 1.5])),
    nn.CrossEntropyLoss(reduction="sum", ignore_index=2),
    nn.CrossEntropyLoss(reduction="none", weight=torch.rand(5)),
], ids=["plain", "smoothing", "weight", "sum-ignore", "none"])
def test_cross_entropy_variants(n, criterion):
    _check(criterion, n, 7, _classes)


@pytest.mark.parametrize("n", [2, 3])
def test_nll_loss_with_weight_and_ignore(n):
    criterion = nn.NLLLoss(weight=torch.rand(5) + 0.1, ignore_index=-100)
    _check(criterion, n, 8, lambda b: _classes(b, ignore_first=2),
           transform=lambda o: o.log_softmax(1))


@pytest.mark.parametrize("n", [2, 3])
def test_cross_entropy_probability_targets(n):
    criterion = nn.CrossEntropyLoss(weight=torch.rand(5) + 0.1, label_smoothing=0.1)
    _check(criterion, n, 7, lambda b: (torch.softmax(torch.randn(b, 5), 1),))


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("criterion", [
    nn.MSELoss(), nn.L1Loss(reduction="sum"), nn.SmoothL1Loss(reduction="none"),
    nn.BCEWithLogitsLoss(pos_weight=torch.rand(5)),
], ids=["mse", "l1-sum", "smoothl1-none", "bce-posweight"])
def test_elementwise_losses(n, criterion):
    _check(criterion, n, 7, lambda b: (torch.rand(b, 5),))


@pytest.mark.parametrize("n", [2, 3])
def test_kl_div_batchmean_and_margin_losses(n):
    _check(nn.KLDivLoss(reduction="batchmean"), n, 7, lambda b: (torch.softmax(torch.randn(b, 5), 1),),
           transform=lambda o: o.log_softmax(1))
    _check(nn.MultiMarginLoss(), n, 7, _classes)


@pytest.mark.parametrize("n", [2, 3])
def test_plain_callable_is_weighted_by_chunk_size(n):
    def loss_fn(output, target):
        return nn.functional.cross_entropy(output, target)

    _check(loss_fn, n, 7, _classes)


class TupleNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(6, 5)
        self.aux = nn.Linear(6, 1)

    def forward(self, x):
        return self.body(x), self.aux(x)


class TupleLoss(nn.Module):
    """Takes the model's tuple unpacked: criterion(logits, aux, target)."""

    def forward(self, logits, aux, target):
        return nn.functional.cross_entropy(logits, target) + aux.mean()


@pytest.mark.parametrize("n", [1, 2, 3])
def test_model_returning_a_tuple(n):
    model = TupleNet()
    reference = copy.deepcopy(model)
    x, t = torch.randn(7, 6), torch.randint(0, 5, (7,))
    loss = DataParallelCriterion(TupleLoss(), ["cpu"] * n)(DataParallelModel(model, ["cpu"] * n)(x), t)
    torch.testing.assert_close(loss, TupleLoss()(*reference(x), t))


def test_criterion_leaves_the_original_untouched_and_reuses():
    criterion = nn.CrossEntropyLoss(weight=torch.rand(5))
    wrapped = DataParallelCriterion(criterion, ["cpu"] * 3)
    outputs = DataParallelModel(_net(), ["cpu"] * 3)(torch.randn(7, 6))
    t = torch.randint(0, 5, (7,))
    first = wrapped(outputs, t)
    assert criterion.reduction == "mean"
    torch.testing.assert_close(wrapped(outputs, t), first)
    criterion.label_smoothing = 0.3  # a changed attribute is seen by the next call
    torch.testing.assert_close(wrapped(outputs, t), criterion(torch.cat(outputs), t))


def test_only_scalar_losses_travel():
    criterion = DataParallelCriterion(nn.CrossEntropyLoss(), ["cpu"] * 3)
    outputs = DataParallelModel(_net(), ["cpu"] * 3)(torch.randn(9, 6))
    with TrafficMeter() as meter:
        criterion(outputs, torch.randint(0, 5, (9,)))
    assert "gather" not in meter.by_kind
    # replicas 1 and 2 send a loss sum and a normaliser (4 bytes each) to replica 0
    assert meter.by_kind["loss"] == 2 * 2 * 4
    # their targets were scattered to them: 3 int64 labels each
    assert meter.by_kind["scatter"] == 2 * 3 * 8


def test_bare_tensor_output_and_errors():
    criterion = DataParallelCriterion(nn.MSELoss(), ["cpu"] * 2)
    out, target = torch.randn(4, 3), torch.randn(4, 3)
    torch.testing.assert_close(criterion(out, target), nn.MSELoss()(out, target))
    with pytest.raises(ValueError, match="5 entries"):
        criterion([out[:2], out[2:]], torch.randn(5, 3))
    with pytest.raises(ValueError, match="CTCLoss"):
        DataParallelCriterion(nn.CTCLoss(), ["cpu"])
