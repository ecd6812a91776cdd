"""tandem.parallel.loss_terms: chunked (S, D) add up to the single-device loss, exactly."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tandem.parallel.loss_terms import (
    LossTerms,
    call_criterion,
    class_normaliser,
    first_tensor,
    loss_terms,
    sample_mean_terms,
    with_reduction,
)

SPLITS = [(7,), (4, 3), (1, 5, 1), (3, 0, 4)]


def _data(kind: str, g: torch.Generator):
    """(output, target) in float64 for a named target kind."""
    if kind == "index":
        return torch.randn(7, 5, generator=g, dtype=torch.float64), torch.tensor([0, 1, 2, 3, 4, 1, 2])
    if kind == "index_ignored":  # the first three targets are ignored: a chunk of them is empty
        return torch.randn(7, 5, generator=g, dtype=torch.float64), torch.tensor([-1, -1, -1, 3, 4, 1, 2])
    if kind == "index_2d":  # (N, C, H, W) logits, (N, H, W) targets
        return (torch.randn(7, 5, 2, 3, generator=g, dtype=torch.float64),
                torch.randint(0, 5, (7, 2, 3), generator=g))
    if kind == "probs":
        return (torch.randn(7, 5, generator=g, dtype=torch.float64),
                torch.rand(7, 5, generator=g, dtype=torch.float64).softmax(1))
    if kind == "probs_2d":  # mean over samples *and* positions
        return (torch.randn(7, 5, 2, 3, generator=g, dtype=torch.float64),
                torch.rand(7, 5, 2, 3, generator=g, dtype=torch.float64).softmax(1))
    if kind == "log_probs":
        return (torch.randn(7, 5, generator=g, dtype=torch.float64).log_softmax(1),
                torch.rand(7, 5, generator=g, dtype=torch.float64).softmax(1))
    return torch.randn(7, 5, generator=g, dtype=torch.float64), torch.rand(7, 5, generator=g, dtype=torch.float64)


def _weight():
    return torch.tensor([0.5, 2.0, 1.0, 3.0, 0.25], dtype=torch.float64)


def _plain_mean(output, target):
    return F.cross_entropy(output, target)


CRITERIA = {
    "ce": (lambda: nn.CrossEntropyLoss(), "index"),
    "ce_weight_ignore_smooth": (
        lambda: nn.CrossEntropyLoss(weight=_weight(), ignore_index=-1, label_smoothing=0.2),
        "index_ignored"),
    "ce_2d_weight": (lambda: nn.CrossEntropyLoss(weight=_weight()), "index_2d"),
    "ce_probs": (lambda: nn.CrossEntropyLoss(label_smoothing=0.1), "probs"),
    "ce_probs_2d": (lambda: nn.CrossEntropyLoss(), "probs_2d"),
    "nll_weight": (lambda: nn.NLLLoss(weight=_weight()), "index"),
    "mse": (lambda: nn.MSELoss(), "dense"),
    "margin": (lambda: nn.MultiMarginLoss(), "index"),
    "l1_sum": (lambda: nn.L1Loss(reduction="sum"), "dense"),
    "kl_batchmean": (lambda: nn.KLDivLoss(reduction="batchmean"), "log_probs"),
    "plain_function": (lambda: _plain_mean, "index"),
}


@pytest.mark.parametrize("split", SPLITS, ids=str)
@pytest.mark.parametrize("name", sorted(CRITERIA))
def test_chunks_add_up_to_the_whole_batch(name, split):
    make, kind = CRITERIA[name]
    criterion = make()
    g = torch.Generator().manual_seed(1)
    output, target = _data(kind, g)
    output.requires_grad_(True)
    whole = criterion(output, target)
    (whole_grad,) = torch.autograd.grad(whole, output)

    total, den = 0.0, 0.0
    for out, tgt in zip(output.split(list(split)), target.split(list(split))):
        if out.shape[0] == 0 and name == "plain_function":
            continue  # F.cross_entropy of 0 samples is NaN: callers skip empty chunks
        terms = loss_terms(criterion, out, (tgt,))
        assert isinstance(terms, LossTerms) and terms.summed.dim() == 0
        total, den = total + terms.summed, den + terms.normaliser
    mean = total if getattr(criterion, "reduction", "mean") == "sum" else total / den
    (grad,) = torch.autograd.grad(mean, output)
    torch.testing.assert_close(mean, whole)
    torch.testing.assert_close(grad, whole_grad)


def test_all_ignored_chunk_is_zero_not_nan():
    criterion = nn.CrossEntropyLoss(weight=_weight(), ignore_index=-1)
    out = torch.randn(3, 5, dtype=torch.float64)
    summed, norm = loss_terms(criterion, out, (torch.tensor([-1, -1, -1]),))
    assert float(summed) == 0.0 and float(norm) == 0.0


def test_normaliser_kinds():
    out, idx = torch.randn(4, 5), torch.tensor([0, 1, -100, 2])
    # depends on target values: a tensor on the output's device (count without weight)
    norm = loss_terms(nn.CrossEntropyLoss(), out, (idx,)).normaliser
    assert isinstance(norm, torch.Tensor) and float(norm) == 3.0 and norm.dtype == torch.float32
    # follows from shapes alone: plain floats
    assert loss_terms(nn.MSELoss(), out, (torch.rand(4, 5),)).normaliser == 20.0
    assert loss_terms(nn.MultiMarginLoss(), out, (idx.clamp(min=0),)).normaliser == 4.0
    assert loss_terms(nn.KLDivLoss(reduction="batchmean"), out, (out.softmax(1),)).normaliser == 4.0
    assert loss_terms(nn.L1Loss(reduction="sum"), out, (torch.rand(4, 5),)).normaliser == 1.0
    assert loss_terms(_plain_mean, out, (idx.clamp(min=0),)).normaliser == 4.0


def test_class_normaliser_stays_exact_in_half_precision():
    # 3000 targets: not representable in float16 (spacing 2 above 2048), exact in float32
    out = torch.zeros(3000, 4, dtype=torch.float16)
    target = torch.zeros(3000, dtype=torch.long)
    target[0] = 1
    norm = class_normaliser(nn.CrossEntropyLoss(ignore_index=1), out, target)
    assert norm.dtype == torch.float32 and float(norm) == 2999.0
    weighted = class_normaliser(nn.CrossEntropyLoss(weight=torch.full((4,), 0.5)), out, target)
    assert float(weighted) == 1500.0
    # probability targets: samples times positions; an unbatched output is one sample
    assert class_normaliser(nn.CrossEntropyLoss(), torch.zeros(2, 4, 3), torch.rand(2, 4, 3)) == 6.0
    assert class_normaliser(nn.CrossEntropyLoss(), torch.zeros(4), torch.rand(4)) == 1.0


def test_criterion_is_left_untouched_and_copies_share_weight():
    criterion = nn.CrossEntropyLoss(weight=_weight())
    copy = with_reduction(criterion, "sum")
    assert copy.reduction == "sum" and criterion.reduction == "mean"
    assert copy.weight is criterion.weight
    loss_terms(criterion, torch.randn(3, 5, dtype=torch.float64), (torch.tensor([0, 1, 2]),))
    assert criterion.reduction == "mean"


def test_tuple_output_and_kwargs_are_passed_through():
    class TupleLoss(nn.Module):
        reduction = "mean"

        def forward(self, logits, aux, target, scale=1.0):
            return scale * (F.cross_entropy(logits, target, reduction=self.reduction) + aux.sum())

    logits, aux, t = torch.randn(3, 5), torch.zeros(3, 1), torch.tensor([0, 1, 2])
    terms = loss_terms(TupleLoss(), (logits, aux), (t,), {"scale": 2.0})
    # a module with a torch reduction but not a known class: mean over unreduced elements
    torch.testing.assert_close(terms.summed / terms.normaliser, 2.0 * F.cross_entropy(logits, t))
    got = call_criterion(lambda a, b, c, k=0.0: a.sum() + b.sum() + c + k, (logits, aux), (1.0,), {"k": 2.0})
    torch.testing.assert_close(got, logits.sum() + 3.0)


def test_plain_callable_counts_samples_along_batch_dim():
    out = torch.randn(5, 3)  # batch along dim 1
    terms = loss_terms(lambda o: o.mean(), out, batch_dim=1)
    assert terms.normaliser == 3.0
    torch.testing.assert_close(terms.summed, out.mean() * 3)
    torch.testing.assert_close(sample_mean_terms(torch.tensor(2.0), 4).summed, torch.tensor(8.0))


def test_first_tensor_finds_nested_tensors():
    t = torch.ones(2)
    assert first_tensor({"a": [None, (3, t)]}) is t
    assert first_tensor([1, "x"]) is None


def test_errors_name_the_problem():
    out, t = torch.randn(2, 3), torch.tensor([0, 1])
    with pytest.raises(ValueError, match="reduction='none'"):
        loss_terms(nn.CrossEntropyLoss(reduction="none"), out, (t,))
    with pytest.raises(ValueError, match="no scalar tensor"):
        loss_terms(lambda o, y: o, out, (t,))
    with pytest.raises(ValueError, match="holds no tensor"):
        loss_terms(nn.MSELoss(), [1, 2], (t,))
