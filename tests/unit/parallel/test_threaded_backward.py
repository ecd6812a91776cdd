"""Replicas that share a device run their backward in their own threads, with the same update.

Against a single-device reference in float64, with a noise-floor control (the same comparison
in float32, scaled to float64's epsilon) and a negative control (a perturbed batch must give
other gradients); and against autograd's one-thread path (``backward_threads=False``).
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tandem.parallel import (DataParallel, DataParallelCriterion, DataParallelModel,
                             convert_sync_batchnorm)

TOL64 = 1e-12
EPS32, EPS64 = torch.finfo(torch.float32).eps, torch.finfo(torch.float64).eps


def _net(dtype=torch.float64, bn=False):
    torch.manual_seed(0)
    layers = [nn.Conv2d(3, 8, 3, padding=1)]
    layers += [nn.BatchNorm2d(8)] if bn else []
    layers += [nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
               nn.Flatten(), nn.Linear(8, 5)]
    return nn.Sequential(*layers).to(dtype)


def _batch(n, dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 3, 6, 6, generator=g).to(dtype), torch.randint(0, 5, (n,), generator=g)


def _grads(model):
    return [p.grad.double().clone() for p in model.parameters()]


def _dist(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def _single(x, y, dtype=torch.float64):
    model = _net(dtype)
    nn.functional.cross_entropy(model(x.to(dtype)), y).backward()
    return _grads(model)


def _dp(x, y, n, dtype=torch.float64, balanced=False, threads=True):
    model = _net(dtype)
    devices = ["cpu"] * n
    if balanced:
        out = DataParallelModel(model, devices, backward_threads=threads)(x.to(dtype))
        loss = DataParallelCriterion(nn.CrossEntropyLoss(), devices)(out, y)
        joined = any("_Join" in type(o.grad_fn).__name__ for o in out)
    else:
        out = DataParallel(model, devices, backward_threads=threads)(x.to(dtype))
        loss = nn.functional.cross_entropy(out, y)
        joined = any("_Join" in type(f).__name__ for f, _ in out.grad_fn.next_functions)
    loss.backward()
    return _grads(model), joined


@pytest.mark.parametrize("balanced", [False, True], ids=["dp", "balanced"])
@pytest.mark.parametrize("n, batch", [(1, 7), (2, 7), (3, 7), (3, 2)])
def test_gradients_equal_the_single_device_ones(n, batch, balanced):
    x, y = _batch(batch)
    reference = _single(x, y)
    got, joined = _dp(x, y, n, balanced=balanced)
    assert joined == (min(n, batch) > 1)  # several replicas on the CPU take the threaded path
    # noise floor: how much this config amplifies rounding, measured in float32
    floor = _dist(_dp(x, y, n, torch.float32, balanced)[0], reference) / EPS32 * EPS64
    assert floor < TOL64 / 2, f"ill-posed: float64 noise floor {floor:.3g}"
    assert _dist(got, reference) < TOL64
    # negative control: another batch must move the gradients far beyond the tolerance
    other = _dp(x + 0.01, y, n, balanced=balanced)[0]
    assert _dist(other, reference) > 1000 * TOL64


def test_same_bits_as_twice_and_close_to_autograd_s_one_thread():
    x, y = _batch(9)
    first, joined = _dp(x, y, 3)
    again, joined_again = _dp(x, y, 3)
    assert joined and joined_again  # both runs took the threaded path
    assert all(torch.equal(a, b) for a, b in zip(first, again))  # the sum's order is fixed
    engine, joined = _dp(x, y, 3, threads=False)
    assert not joined
    assert _dist(first, engine) < TOL64


def test_every_replica_runs_its_backward_in_a_thread_of_its_own():
    seen: dict = {}

    class Probe(nn.Module):
        def forward(self, x):
            x = x.clone()
            size = x.shape[0]
            x.register_hook(lambda g: seen.setdefault(size, threading.get_ident()) and None)
            return x

    model = nn.Sequential(nn.Linear(4, 4), Probe(), nn.Linear(4, 2))
    DataParallel(model, ["cpu", "cpu"], backward_threads=True)(torch.randn(5, 4)).sum().backward()
    assert sorted(seen) == [2, 3]  # both chunks' backward ran
    assert len(set(seen.values())) == 2 and threading.get_ident() not in seen.values()


def _sync_bn_grads(x, y, n, threads=True, dtype=torch.float64):
    model = convert_sync_batchnorm(_net(dtype, bn=True))
    out = DataParallel(model, ["cpu"] * n, backward_threads=threads)(x.to(dtype))
    joined = any("_Join" in type(f).__name__ for f, _ in out.grad_fn.next_functions)
    nn.functional.cross_entropy(out, y).backward()
    return _grads(model) + [model[1].running_mean.double(), model[1].running_var.double()], joined


@pytest.mark.parametrize("n, batch", [(2, 7), (3, 7), (3, 2)])
def test_sync_batchnorm_replicas_meet_in_backward_threads_exactly(n, batch):
    x, y = _batch(batch)
    reference = _net(bn=True)
    nn.functional.cross_entropy(reference(x), y).backward()
    expected = _grads(reference) + [reference[1].running_mean, reference[1].running_var]
    got, joined = _sync_bn_grads(x, y, n)
    assert joined
    floor = _dist(_sync_bn_grads(x, y, n, dtype=torch.float32)[0], expected) / EPS32 * EPS64
    assert floor < TOL64 / 2, f"ill-posed: float64 noise floor {floor:.3g}"
    assert _dist(got, expected) < TOL64
    again, _ = _sync_bn_grads(x, y, n)
    assert all(torch.equal(a, b) for a, b in zip(got, again))
    engine, joined = _sync_bn_grads(x, y, n, threads=False)
    assert not joined and _dist(got, engine) < TOL64
    # negative control: plain batch norm per replica normalises each chunk on its own
    model = _net(bn=True)
    nn.functional.cross_entropy(DataParallel(model, ["cpu"] * n)(x), y).backward()
    assert _dist(_grads(model), expected[:-2]) > 1000 * TOL64


@pytest.mark.parametrize("threads, replicas, expected", [(1, 2, True), (2, 3, True),
                                                        (2, 2, False), (4, 3, False)])
def test_by_default_the_threads_run_where_they_add_cores(threads, replicas, expected):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x, y = _batch(6)
        out = DataParallel(_net(), ["cpu"] * replicas)(x)
        joined = any("_Join" in type(f).__name__ for f, _ in out.grad_fn.next_functions)
        forced = DataParallel(_net(), ["cpu"] * replicas, backward_threads=True)(x)
        never = DataParallel(_net(), ["cpu"] * replicas, backward_threads=False)(x)
        split = DataParallel(_net(), ["cpu"] * replicas, split=(2,) + (1,) * (replicas - 1))(x)
    finally:
        torch.set_num_threads(before)
    assert joined == expected
    assert any("_Join" in type(f).__name__ for f, _ in split.grad_fn.next_functions)
    assert any("_Join" in type(f).__name__ for f, _ in forced.grad_fn.next_functions)
    assert not any("_Join" in type(f).__name__ for f, _ in never.grad_fn.next_functions)


def test_sync_batchnorm_replica_whose_output_is_unused_still_meets_the_others():
    x, y = _batch(6)
    model = convert_sync_batchnorm(_net(bn=True))
    out = DataParallelModel(model, ["cpu"] * 3, backward_threads=True)(x)
    nn.functional.cross_entropy(out[0], y[:2], reduction="sum").backward()  # replica 0 only
    reference = _net(bn=True)
    nn.functional.cross_entropy(reference(x)[:2], y[:2], reduction="sum").backward()
    assert _dist(_grads(model), _grads(reference)) < TOL64


def test_buffers_of_the_home_replica_update_in_place():
    model = _net(bn=True)
    before = model[1].running_mean.clone()
    x, _ = _batch(6)
    out = DataParallel(model, ["cpu"] * 2, backward_threads=True)(x)
    assert any("_Join" in type(f).__name__ for f, _ in out.grad_fn.next_functions)  # threaded
    out.sum().backward()
    reference = _net(bn=True)
    reference(x[:3])
    assert torch.equal(model[1].running_mean, reference[1].running_mean)
    assert not torch.equal(model[1].running_mean, before)
    assert int(model[1].num_batches_tracked) == 1


def test_an_error_in_a_replica_s_backward_names_the_replica():
    class Fails(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.rows = x.shape[0]
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            if ctx.rows == 2:
                raise ValueError("bad gradient")
            return g

    class Net(nn.Linear):
        def forward(self, x):
            return Fails.apply(super().forward(x))

    out = DataParallel(Net(4, 2), ["cpu", "cpu"], backward_threads=True)(torch.randn(5, 4))
    with pytest.raises(ValueError, match="replica 1 on cpu: bad gradient"):
        out.sum().backward()


def test_double_backward_is_one_clear_error():
    model = _net()
    x, y = _batch(4)
    loss = nn.functional.cross_entropy(DataParallel(model, ["cpu"] * 2, backward_threads=True)(x), y)
    with pytest.raises(RuntimeError, match="backward_threads=False"):
        torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
    # the one-thread path supports it
    loss = nn.functional.cross_entropy(
        DataParallel(model, ["cpu"] * 2, backward_threads=False)(x), y)
    grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
    assert grads[0].requires_grad


def test_reentrant_checkpointing_inside_a_replica():
    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = _net()

        def forward(self, x):
            first, rest = self.inner[0], self.inner[1:]
            return checkpoint(rest, first(x), use_reentrant=True)

    x, y = _batch(6)
    model = Checkpointed()
    nn.functional.cross_entropy(DataParallel(model, ["cpu"] * 2, backward_threads=True)(x), y).backward()
    assert _dist(_grads(model), _single(x, y)) < TOL64


def test_frozen_and_unused_parameters_get_no_gradient():
    class WithUnused(nn.Module):
        def __init__(self):
            super().__init__()
            self.net, self.unused = _net(), nn.Linear(3, 3).double()

        def forward(self, x):
            return self.net(x)

    model = WithUnused()
    model.net[0].weight.requires_grad_(False)
    x, y = _batch(5)
    nn.functional.cross_entropy(DataParallel(model, ["cpu"] * 2, backward_threads=True)(x), y).backward()
    assert model.net[0].weight.grad is None and model.unused.weight.grad is None
    assert model.net[0].bias.grad is not None


def test_inputs_that_need_a_gradient_keep_autograd_s_path():
    model = _net()
    x, y = _batch(5)
    x.requires_grad_(True)
    nn.functional.cross_entropy(DataParallel(model, ["cpu"] * 2, backward_threads=True)(x), y).backward()
    reference = x.detach().clone().requires_grad_(True)
    nn.functional.cross_entropy(_net()(reference), y).backward()
    assert (x.grad - reference.grad).abs().max().item() < TOL64


def test_tied_parameters_sum_every_use():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a = nn.Linear(4, 4).double()
            self.b = nn.Linear(4, 4).double()
            self.b.weight = self.a.weight  # one Parameter, used twice

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)))

    x = torch.randn(7, 4, dtype=torch.float64)
    reference = Tied()
    reference(x).pow(2).sum().backward()
    model = Tied()
    out = DataParallel(model, ["cpu"] * 3, backward_threads=True)(x)
    assert any("_Join" in type(f).__name__ for f, _ in out.grad_fn.next_functions)
    out.pow(2).sum().backward()
    assert model.a.weight is model.b.weight
    assert _dist(_grads(model), _grads(reference)) < TOL64
    untied = Tied()
    untied.b.weight = nn.Parameter(untied.a.weight.detach().clone())  # negative control
    DataParallel(untied, ["cpu"] * 3, backward_threads=True)(x).pow(2).sum().backward()
    assert (untied.a.weight.grad - reference.a.weight.grad).abs().max() > 1000 * TOL64
