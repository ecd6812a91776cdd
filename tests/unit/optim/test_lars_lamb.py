"""LARS and LAMB against the papers' update rules computed by hand, in plain Python floats, on a
few parameters over two steps (the learning rate changed between them, as a schedule does):
You et al. 2017 (LARS, Algorithm 1) and You et al. 2019 (LAMB, Algorithm 2)."""

import math

import pytest
import torch

from tandem.optim import LAMB, LARS, create_optimizer
from tandem.plain_norms import PlainNorms

W = [[0.5, -1.0], [2.0, 0.25]]  # a layer's weight
B = [0.1, -0.2, 0.3]  # a bias
GRADS = [([[0.2, 0.1], [-0.3, 0.4]], [0.05, 0.0, -0.1]),  # step 1
         ([[-0.1, 0.3], [0.2, 0.2]], [0.02, 0.1, 0.0])]  # step 2
LRS = [0.5, 0.3]


def flat(x):
    return [v for row in x for v in row] if isinstance(x[0], list) else list(x)


def norm(values):
    return math.sqrt(sum(v * v for v in values))


def params():
    w = torch.tensor(W, dtype=torch.float64, requires_grad=True)
    b = torch.tensor(B, dtype=torch.float64, requires_grad=True)
    return w, b


def run(optimizer, w, b):
    for (gw, gb), lr in zip(GRADS, LRS):
        for group in optimizer.param_groups:
            group["lr"] = lr
        w.grad = torch.tensor(gw, dtype=torch.float64)
        b.grad = torch.tensor(gb, dtype=torch.float64)
        optimizer.step()
    return flat(w.tolist()), b.tolist()


def lars_by_hand(x, grads, lrs, m, beta, eta, eps, trust=True):
    """Algorithm 1: lambda = eta |w| / (|g| + beta |w|); v = m v + lr lambda (g + beta w);
    w = w - v."""
    v = [0.0] * len(x)
    for g, lr in zip(grads, lrs):
        local = eta * norm(x) / (norm(g) + beta * norm(x) + eps) if trust else 1.0
        v = [m * vi + lr * local * (gi + beta * xi) for vi, gi, xi in zip(v, g, x)]
        x = [xi - vi for xi, vi in zip(x, v)]
    return x


def lamb_by_hand(x, grads, lrs, b1, b2, eps, lam, trust=True):
    """Algorithm 2 (phi the identity): m, v with bias correction, r = m^/(sqrt(v^)+eps),
    u = r + lam x, x = x - lr |x|/|u| u."""
    m = [0.0] * len(x)
    v = [0.0] * len(x)
    for t, (g, lr) in enumerate(zip(grads, lrs), start=1):
        m = [b1 * mi + (1 - b1) * gi for mi, gi in zip(m, g)]
        v = [b2 * vi + (1 - b2) * gi * gi for vi, gi in zip(v, g)]
        r = [(mi / (1 - b1 ** t)) / (math.sqrt(vi / (1 - b2 ** t)) + eps) for mi, vi in zip(m, v)]
        u = [ri + lam * xi for ri, xi in zip(r, x)]
        ratio = norm(x) / norm(u) if trust and norm(x) > 0 and norm(u) > 0 else 1.0
        x = [xi - lr * ratio * ui for xi, ui in zip(x, u)]
    return x


def test_lars_takes_algorithm_1s_steps_layer_by_layer():
    w, b = params()
    opt = LARS([w, b], lr=1.0, momentum=0.9, weight_decay=0.01, trust_coefficient=0.02, eps=0.0)
    got_w, got_b = run(opt, w, b)
    want_w = lars_by_hand(flat(W), [flat(g) for g, _ in GRADS], LRS, 0.9, 0.01, 0.02, 0.0)
    want_b = lars_by_hand(B, [g for _, g in GRADS], LRS, 0.9, 0.01, 0.02, 0.0)
    assert got_w == pytest.approx(want_w, abs=1e-14)
    assert got_b == pytest.approx(want_b, abs=1e-14)
    # the trust ratio moved the weight far less than a plain momentum step would have
    plain = lars_by_hand(flat(W), [flat(g) for g, _ in GRADS], LRS, 0.9, 0.01, 0.02, 0.0,
                         trust=False)
    assert max(abs(a - c) for a, c in zip(got_w, plain)) > 0.1


def test_lars_leaves_a_group_without_trust_at_the_plain_momentum_step():
    w, b = params()
    opt = LARS([{"params": [w]}, {"params": [b], "weight_decay": 0.0, "trust": False}],
               lr=1.0, momentum=0.9, weight_decay=0.01, trust_coefficient=0.02, eps=0.0)
    _, got_b = run(opt, w, b)
    assert got_b == pytest.approx(lars_by_hand(B, [g for _, g in GRADS], LRS, 0.9, 0.0, 0.02,
                                               0.0, trust=False), abs=1e-14)


def test_lamb_takes_algorithm_2s_steps_layer_by_layer():
    w, b = params()
    opt = LAMB([w, b], lr=1.0, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    got_w, got_b = run(opt, w, b)
    want_w = lamb_by_hand(flat(W), [flat(g) for g, _ in GRADS], LRS, 0.8, 0.95, 1e-6, 0.1)
    want_b = lamb_by_hand(B, [g for _, g in GRADS], LRS, 0.8, 0.95, 1e-6, 0.1)
    assert got_w == pytest.approx(want_w, abs=1e-14)
    assert got_b == pytest.approx(want_b, abs=1e-14)
    assert opt.state[w]["step"] == 2


def test_lamb_without_trust_is_adams_step_and_a_zero_weight_keeps_ratio_one():
    w, b = params()
    with torch.no_grad():
        b.zero_()  # |x| = 0: the ratio is 1, not 0 (the layer would never move)
    opt = LAMB([{"params": [w], "trust": False}, {"params": [b]}], lr=1.0, betas=(0.8, 0.95),
               eps=1e-6, weight_decay=0.0)
    got_w, got_b = run(opt, w, b)
    grads_b = [g for _, g in GRADS]
    assert got_w == pytest.approx(lamb_by_hand(flat(W), [flat(g) for g, _ in GRADS], LRS,
                                               0.8, 0.95, 1e-6, 0.0, trust=False), abs=1e-14)
    # step 1 from zero weights: ratio 1 (Adam's step); step 2: |x| > 0, the trust ratio
    assert got_b == pytest.approx(lamb_by_hand([0.0] * 3, grads_b, LRS, 0.8, 0.95, 1e-6, 0.0),
                                  abs=1e-14)
    assert got_b != pytest.approx(lamb_by_hand([0.0] * 3, grads_b, LRS, 0.8, 0.95, 1e-6, 0.0,
                                               trust=False), abs=1e-3)


@pytest.mark.parametrize("name", ["lars", "lamb"])
def test_a_layer_in_two_blocks_steps_as_the_whole_layer_with_its_plain_norms(name):
    """The weight cut into two row blocks (as hybrid's shards), the norms summed over both
    (PlainNorms owners): the blocks end as the whole layer's rows; taken per block they do not
    (the negative control)."""
    def make(params, norms=None):
        return create_optimizer(name, params, lr=0.5, weight_decay=0.01,
                                trust_coefficient=0.02, norms=norms)

    whole = torch.tensor(W, dtype=torch.float64, requires_grad=True)
    top, bottom = (torch.tensor([row], dtype=torch.float64, requires_grad=True) for row in W)
    runs = {"whole": (make([whole]), [whole]),
            "blocks": (make([top, bottom], PlainNorms([top, bottom], [0, 0])), [top, bottom]),
            "per block": (make([top2 := top.detach().clone().requires_grad_(),
                                bottom2 := bottom.detach().clone().requires_grad_()]),
                          [top2, bottom2])}
    for gw, _ in GRADS:
        for opt, ps in runs.values():
            grads = [torch.tensor(gw, dtype=torch.float64)] if len(ps) == 1 else \
                [torch.tensor([row], dtype=torch.float64) for row in gw]
            for p, g in zip(ps, grads):
                p.grad = g
            opt.step()
    merged = torch.cat([top, bottom]).detach()
    assert (merged - whole.detach()).abs().max() < 1e-15
    assert (torch.cat([top2, bottom2]).detach() - whole.detach()).abs().max() > 1e-3
