"""Engine edge cases (issue 16) against the plain module on one device, at 2 and 3 CPU replicas."""

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

from tandem.parallel import (
    DataParallel,
    DataParallelCriterion,
    DataParallelModel,
    convert_sync_batchnorm,
    data_parallel,
    gather,
    replicate,
)

REPLICAS = [2, 3]
close = dict(rtol=1e-9, atol=1e-10)  # float64 where exactness matters


def _grads(model):
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _assert_all_close(xs, ys):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        torch.testing.assert_close(x, y)


# -- 1. lazy modules ---------------------------------------------------------------------------
def _lazy_net():
    f64 = dict(dtype=torch.float64)
    return nn.Sequential(nn.LazyLinear(48, **f64), nn.ReLU(), nn.LazyLinear(3, **f64))


@pytest.mark.parametrize("n", REPLICAS)
def test_lazy_modules_initialise_once_like_one_device(n):
    """200 fresh lazy nets: every output and gradient equals the plain net's; never a race."""
    wrong, errors = 0, []
    x = torch.randn(5, 32, dtype=torch.float64)
    for seed in range(200):
        torch.manual_seed(seed)
        reference = _lazy_net()
        ref_out = reference(x)
        torch.manual_seed(seed)
        model = _lazy_net()
        try:
            out = DataParallel(model, ["cpu"] * n)(x)
        except Exception as exc:  # the race shows as errors as well as wrong values
            errors.append(repr(exc))
            continue
        if out.shape != ref_out.shape or not torch.allclose(out, ref_out, **close):
            wrong += 1
            continue
        if seed % 50 == 0:  # gradients reach the materialised parameters
            out.sum().backward()
            ref_out.sum().backward()
            _assert_all_close(_grads(model), _grads(reference))
    assert (wrong, errors[:3]) == (0, [])


@pytest.mark.parametrize("n", REPLICAS)
def test_lazy_modules_through_data_parallel_and_model(n):
    x = torch.randn(4, 6, dtype=torch.float64)
    torch.manual_seed(1)
    ref_out = _lazy_net()(x)
    torch.manual_seed(1)
    torch.testing.assert_close(data_parallel(_lazy_net(), x, ["cpu"] * n), ref_out)
    torch.manual_seed(1)
    outs = DataParallelModel(_lazy_net(), ["cpu"] * n)(x)
    torch.testing.assert_close(torch.cat(outs), ref_out)


def test_replicate_refuses_an_uninitialised_lazy_module():
    with pytest.raises(ValueError, match=r"0\.weight.*uninitiali[sz]ed.*once"):
        replicate(_lazy_net(), ["cpu", "cpu"])


# -- 2. zero_grad inside a replica's forward -------------------------------------------------------
class ZeroGradInForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 2)
        self.clear = True

    def forward(self, x):
        if self.clear:
            self.zero_grad()
            self.b.zero_grad(set_to_none=False)
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("n", REPLICAS)
def test_zero_grad_in_a_replica_warns_and_keeps_the_real_gradients(n):
    """torch's rule: zero_grad in a replica has no effect; replica 0 (the module) included."""
    model = ZeroGradInForward()
    reference = copy.deepcopy(model)
    reference.clear = False  # what the replicas must amount to
    wrapped = DataParallel(model, ["cpu"] * n)
    x1, x2 = torch.randn(5, 4), torch.randn(4, 4)
    with pytest.warns(UserWarning, match="no effect"):
        wrapped(x1).square().sum().backward()
    reference(x1).square().sum().backward()
    before = _grads(reference)
    _assert_all_close(_grads(model), before)
    with pytest.warns(UserWarning, match="no effect"):
        out = wrapped(x2)  # accumulating a second batch
    _assert_all_close(_grads(model), before)
    out.square().sum().backward()
    reference(x2).square().sum().backward()
    _assert_all_close(_grads(model), _grads(reference))
    guards = [m.__dict__["zero_grad"] for m in model.modules()]  # installed once, not per call
    wrapped.eval()
    with pytest.warns(UserWarning, match="no effect"):
        wrapped(x1)
    assert [m.__dict__["zero_grad"] for m in model.modules()] == guards
    model.b.zero_grad(set_to_none=False)  # outside a parallel call it works as usual
    assert all(not p.grad.any() for p in model.b.parameters())
    model.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_the_zero_grad_guard_follows_copies_and_pickles():
    """A deep copy's guard clears the copy's gradients, never the original's; a pickled module
    keeps a working guard."""
    import pickle

    model = ZeroGradInForward()
    model.clear = False
    DataParallel(model, ["cpu"] * 2)(torch.randn(4, 4)).sum().backward()
    twin = copy.deepcopy(model)
    twin.zero_grad()
    assert all(p.grad is None for p in twin.parameters())
    assert all(p.grad is not None for p in model.parameters())  # the original kept its own
    again = pickle.loads(pickle.dumps(model))
    again.zero_grad()
    assert all(p.grad is None for p in again.parameters())
    assert all(p.grad is not None for p in model.parameters())


# -- 3. no inputs --------------------------------------------------------------------------------
class NoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("x", torch.randn(2, 4))
        self.calls = []  # shared by the shallow replicas: counts every replica's call

    def forward(self, scale=1.0):
        self.calls.append(1)
        return self.lin(self.x) * scale


@pytest.mark.parametrize("n", REPLICAS)
def test_a_module_with_no_inputs_runs_once(n):
    model = NoInputs()
    reference = copy.deepcopy(model)
    devices = ["cpu"] * n
    cases = [
        (lambda: DataParallel(model, devices)(), lambda: reference()),
        (lambda: DataParallel(model, devices)(scale=2.0), lambda: reference(scale=2.0)),
        (lambda: data_parallel(model, (), devices), lambda: reference()),
        (lambda: data_parallel(model, None, devices), lambda: reference()),
        (lambda: data_parallel(model, None, ["cpu"]), lambda: reference()),
        (lambda: DataParallelModel(model, devices)()[0], lambda: reference()),
    ]
    for k, (parallel, plain) in enumerate(cases):
        model.calls.clear()
        out, ref_out = parallel(), plain()
        assert out.shape == ref_out.shape == (2, 3), k
        torch.testing.assert_close(out, ref_out)
        assert len(model.calls) == 1, k
    assert len(DataParallelModel(model, devices)()) == 1
    model.zero_grad(), reference.zero_grad()
    DataParallel(model, devices)().sum().backward()
    reference().sum().backward()
    _assert_all_close(_grads(model), _grads(reference))


# -- 4. no reference cycle ---------------------------------------------------------------------------
def _freed_by_refcount(build_and_run):
    """Whether everything ``build_and_run`` made is gone as soon as its references are."""
    gc.collect()
    gc.disable()
    try:
        refs = build_and_run()
        return all(r() is None for r in refs)
    finally:
        gc.enable()


@pytest.mark.parametrize("n", REPLICAS)
@pytest.mark.parametrize("share", [True, False])
def test_a_dropped_wrapper_is_freed_by_reference_counting(n, share):
    devices = ["cpu"] * n

    def net():
        return nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Linear(5, 2))

    def run_dp():
        model = net()
        wrapped = (DataParallel if share else CopiedDP)(model, devices, buffers="average")
        for _ in range(2):  # second call: cached replicas
            wrapped(torch.randn(7, 4)).sum().backward()
        return [weakref.ref(model), weakref.ref(wrapped)]

    def run_balanced():
        model, criterion = net(), nn.CrossEntropyLoss()
        loss = DataParallelCriterion(criterion, devices)(
            DataParallelModel(model, devices)(torch.randn(7, 4)), torch.randint(0, 2, (7,)))
        loss.backward()
        return [weakref.ref(model), weakref.ref(criterion)]

    def run_function():
        model = net()
        data_parallel(model, torch.randn(8, 4), devices).sum().backward()
        return [weakref.ref(model)]

    assert _freed_by_refcount(run_dp)
    assert _freed_by_refcount(run_balanced)
    assert _freed_by_refcount(run_function)


# -- 5. outputs with the batch in another dimension -------------------------------------------------
@pytest.mark.parametrize("n, batch", [(2, 5), (3, 4)])  # uneven chunks: 3+2 and 2+1+1
def test_uneven_gather_of_a_batch_in_dim_1_names_the_output(n, batch):
    lstm = nn.LSTM(4, 5, batch_first=True)  # out (B, T, 5); h and c (1, B, 5)
    x = torch.randn(batch, 3, 4)
    with pytest.raises(ValueError, match=r"output\[1\]\[0\].*gather_dim"):
        DataParallel(lstm, ["cpu"] * n)(x)


@pytest.mark.parametrize("n, batch", [(2, 5), (3, 4)])
@pytest.mark.parametrize("share", [True, False])
def test_per_output_gather_dim_matches_one_device(n, batch, share):
    lstm = nn.LSTM(4, 5, batch_first=True).double()
    reference = copy.deepcopy(lstm)
    x = torch.randn(batch, 3, 4, dtype=torch.float64)
    wrapper = DataParallel if share else CopiedDP
    out, (h, c) = wrapper(lstm, ["cpu"] * n, gather_dim=(0, 1))(x)
    ref_out, (ref_h, ref_c) = reference(x)
    _assert_all_close([out, h, c], [ref_out, ref_h, ref_c])
    (out.sum() + h.square().sum() + c.sum()).backward()
    (ref_out.sum() + ref_h.square().sum() + ref_c.sum()).backward()
    _assert_all_close(_grads(lstm), _grads(reference))


def test_gather_error_names_a_dict_entry():
    outs = [{"logits": torch.zeros(2, 3), "state": torch.zeros(1, k, 3)} for k in (2, 1)]
    with pytest.raises(ValueError, match=r"output\['state'\]"):
        gather(outs, "cpu")
    got = gather(outs, "cpu", dim={"logits": 0, "state": 1})
    assert got["logits"].shape == (4, 3) and got["state"].shape == (1, 3, 3)


# -- 6. the copy-and-reduce path on CPU -----------------------------------------------------------
class CopiedDP(DataParallel):
    """DataParallel whose replicas hold their own parameter copies (the multi-GPU path). No CPU
    backward threads: their detached replicas would bypass this ``replicate``."""

    def __init__(self, *args, **kw):
        super().__init__(*args, backward_threads=False, **kw)

    def replicate(self, module, device_ids, *chunks):
        replicas = replicate(module, device_ids, share_params=False)
        self.copies = [r for r in replicas if r is not module]  # the last forward's copies
        return replicas


def test_copied_replicas_hold_their_own_differentiable_copies():
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    net[0].bias.requires_grad_(False)
    replicas = replicate(net, ["cpu"] * 3, share_params=False)
    assert replicas[0] is net
    for r in replicas[1:]:
        for mine, original in zip(r.parameters(), net.parameters()):
            assert mine is not original and mine.data_ptr() != original.data_ptr()
            torch.testing.assert_close(mine, original)
            assert mine.requires_grad == original.requires_grad
        assert "Broadcast" in type(r[1].weight.grad_fn).__name__
    assert replicate(net, ["cpu"], share_params=False) == [net]
    lstm = nn.LSTM(4, 5)  # an RNN computes from its list of flat weights: they must be the copies
    for r in replicate(lstm, ["cpu"] * 2, share_params=False)[1:]:
        assert [id(w) for w in r._flat_weights] == [id(p) for p in r.parameters()]


def _mlp():
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    net[2].bias.requires_grad_(False)  # a frozen parameter goes through the copy too
    return net.double()


@pytest.mark.parametrize("n", REPLICAS)
def test_copy_path_sgd_steps_match_one_device(n):
    model = _mlp()
    reference = copy.deepcopy(model)
    wrapped = CopiedDP(model, ["cpu"] * n)
    trainable = lambda m: [p for p in m.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trainable(model), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(trainable(reference), lr=0.1, momentum=0.9)
    for batch in (7, 5, 2, 8):  # uneven chunks and a batch smaller than the replica count
        x = torch.randn(batch, 6, dtype=torch.float64)
        _step_alongside(wrapped, model, reference, (opt, ref_opt), x)
    assert wrapped.copies  # the forward went through the copy path (a replica of its own)


def _step_alongside(wrapped, model, reference, opts, x):
    """One SGD step of ``wrapped`` and of ``reference`` on ``x``: outputs, grads, weights equal."""
    for opt in opts:
        opt.zero_grad()
    out, ref_out = wrapped(x), reference(x)
    torch.testing.assert_close(out, ref_out, **close)
    out.square().mean().backward()
    ref_out.square().mean().backward()
    _assert_all_close(_grads(model), _grads(reference))
    for opt in opts:
        opt.step()
    _assert_all_close(list(model.parameters()), list(reference.parameters()))


def _bn_net():
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 3 * 3, 3), nn.BatchNorm1d(3)).double()


@pytest.mark.parametrize("n", REPLICAS)
@pytest.mark.parametrize("policy", ["replica0", "average"])
def test_copy_path_buffers_match_the_shared_path(n, policy):
    """Plain batch norm differs from one device by design; the two paths must agree exactly."""
    copied_model = _bn_net()
    shared_model = copy.deepcopy(copied_model)
    copied = CopiedDP(copied_model, ["cpu"] * n, buffers=policy)
    shared = DataParallel(shared_model, ["cpu"] * n, buffers=policy)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (copied_model, shared_model)]
    for batch in (7, 9, 8):  # chunks of 2 or more: batch norm needs them
        x = torch.randn(batch, 3, 5, 5, dtype=torch.float64)
        _step_alongside(copied, copied_model, shared, opts, x)  # the wrapper holds shared_model
        _assert_all_close(list(copied_model.buffers()), list(shared_model.buffers()))


@pytest.mark.parametrize("n", REPLICAS)
def test_copy_path_sync_batchnorm_matches_one_device(n):
    reference = _bn_net()
    model = convert_sync_batchnorm(copy.deepcopy(reference))
    wrapped = CopiedDP(model, ["cpu"] * n)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for batch in (7, 5, 3):
        x = torch.randn(batch, 3, 5, 5, dtype=torch.float64)
        _step_alongside(wrapped, model, reference, (opt, ref_opt), x)
        _assert_all_close(list(model.buffers()), list(reference.buffers()))


@pytest.mark.parametrize("n", REPLICAS)
def test_copy_path_balanced_model_and_criterion_match_one_device(n):
    model = _mlp()
    reference = copy.deepcopy(model)

    class CopiedDPM(DataParallelModel):
        replicate = CopiedDP.replicate

        def __init__(self, *args, **kw):
            super().__init__(*args, backward_threads=False, **kw)

    weight = torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)
    criterion = DataParallelCriterion(nn.CrossEntropyLoss(weight=weight), ["cpu"] * n)
    x, y = torch.randn(7, 6, dtype=torch.float64), torch.randint(0, 3, (7,))
    copied = CopiedDPM(model, ["cpu"] * n)
    loss = criterion(copied(x), y)
    assert copied.copies  # the forward went through the copy path (a replica of its own)
    ref_loss = nn.CrossEntropyLoss(weight=weight)(reference(x), y)
    torch.testing.assert_close(loss, ref_loss, **close)
    loss.backward(), ref_loss.backward()
    _assert_all_close(_grads(model), _grads(reference))


# -- the same kinds of bugs elsewhere ----------------------------------------------------------------
def _two_part_net(lazy: bool):
    model = nn.Module()
    model.features = nn.Sequential(nn.LazyConv2d(4, 3) if lazy else nn.Conv2d(3, 4, 3), nn.ReLU())
    model.classifier = nn.Sequential(nn.Linear(4 * 4 * 4, 8), nn.ReLU(), nn.Linear(8, 3))
    return model


def test_hybrid_parallel_refuses_a_lazy_model_by_name():
    from tandem.hybrid import HybridParallel

    with pytest.raises(ValueError, match=r"HybridParallel.*features\.0\.weight.*once"):
        HybridParallel(_two_part_net(lazy=True), ["cpu", "cpu"])


@pytest.mark.parametrize("n", REPLICAS)
def test_a_dropped_hybrid_parallel_is_freed_by_reference_counting(n):
    from tandem.hybrid import HybridParallel

    def run():
        model = _two_part_net(lazy=False)
        wrapped = HybridParallel(model, ["cpu"] * n)
        wrapped(torch.randn(5, 3, 6, 6)).sum().backward()
        return [weakref.ref(model), weakref.ref(wrapped)]

    assert _freed_by_refcount(run)
