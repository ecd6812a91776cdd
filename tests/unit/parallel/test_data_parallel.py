"""DataParallel and data_parallel against one device running the whole batch."""

import copy

import pytest
import torch
from torch import nn

from tandem.parallel import DataParallel, data_parallel

DEVICE_COUNTS = [1, 2, 3, 4]
BATCHES = [8, 7, 2]  # even, uneven, smaller than most device counts


def _model():
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, stride=2),
        nn.Flatten(), nn.Linear(4 * 3 * 3, 5),
    )


def _bn_model():
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 5 * 5, 3))


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("n", DEVICE_COUNTS)
@pytest.mark.parametrize("batch", BATCHES)
def test_outputs_grads_and_sgd_step_match_single_device(n, batch):
    model = _model()
    reference = copy.deepcopy(model)
    wrapped = DataParallel(model, ["cpu"] * n)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    x, target = torch.randn(batch, 3, 8, 8), torch.randn(batch, 5)

    out, ref_out = wrapped(x), reference(x)
    torch.testing.assert_close(out, ref_out)
    nn.functional.mse_loss(out, target).backward()
    nn.functional.mse_loss(ref_out, target).backward()
    for g, r in zip(_grads(model), _grads(reference)):
        torch.testing.assert_close(g, r)
    opt.step(), ref_opt.step()
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, r)


@pytest.mark.parametrize("n", [2, 3])
def test_reused_replicas_track_the_module_over_steps(n):
    """Several steps with train/eval switches, a changed attribute and a replaced layer."""
    model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.0), nn.ReLU(), nn.Linear(8, 2))
    reference = copy.deepcopy(model)
    wrapped = DataParallel(model, ["cpu"] * n)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(5):
        if step == 2:  # replaced parameter object: the replicas must be rebuilt
            model[3] = nn.Linear(8, 2)
            reference[3] = copy.deepcopy(model[3])
            opt = torch.optim.SGD(model.parameters(), lr=0.5)
            ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
        if step == 3:  # a plain attribute change must reach the cached replicas
            for m in (model, reference):
                m[1].p = 1.0  # dropout of everything: outputs are the last bias only
        x = torch.randn(5 + step, 6)
        opt.zero_grad(), ref_opt.zero_grad()
        out, ref_out = wrapped(x), reference(x)
        torch.testing.assert_close(out, ref_out)
        out.square().mean().backward()
        ref_out.square().mean().backward()
        opt.step(), ref_opt.step()
        for p, r in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p, r)
        if step == 3:
            for m in (model, reference):
                m[1].p = 0.0


def test_eval_switch_reaches_replicas():
    model = _bn_model()
    reference = copy.deepcopy(model)
    wrapped = DataParallel(model, ["cpu"] * 2)
    x = torch.randn(6, 3, 7, 7)
    wrapped(x), reference(x[:3])  # train step: replica 0 saw the first chunk
    wrapped.eval(), reference.eval()
    torch.testing.assert_close(wrapped(x), reference(x))


def _bn_expected(model, chunks, momentum=0.1):
    """Running mean after one step of plain BN on each chunk, starting from the current one."""
    bn = model[1]
    means = []
    for c in chunks:
        with torch.no_grad():
            h = model[0](c)
        means.append((1 - momentum) * bn.running_mean + momentum * h.mean(dim=(0, 2, 3)))
    return means


@pytest.mark.parametrize("n", [2, 3, 4])
def test_buffer_policies(n):
    x = torch.randn(7, 3, 7, 7)
    sizes = [len(c) for c in torch.tensor_split(torch.arange(7), n)]
    sizes.sort(reverse=True)  # scatter puts the larger chunks first
    chunks = list(torch.split(x, sizes))
    base = _bn_model()
    expected = _bn_expected(base, chunks)

    replica0 = copy.deepcopy(base)
    DataParallel(replica0, ["cpu"] * n, buffers="replica0")(x)
    torch.testing.assert_close(replica0[1].running_mean, expected[0])

    averaged = copy.deepcopy(base)
    DataParallel(averaged, ["cpu"] * n, buffers="average")(x)
    weighted = sum(s * m for s, m in zip(sizes, expected)) / sum(sizes)
    torch.testing.assert_close(averaged[1].running_mean, weighted)
    # the full-batch running mean, as one device computes it
    full = copy.deepcopy(base)
    full(x)
    torch.testing.assert_close(averaged[1].running_mean, full[1].running_mean)
    assert averaged[1].num_batches_tracked.item() == 1  # counts steps, not replicas


def test_average_policy_keeps_backward_working():
    model = _bn_model()
    wrapped = DataParallel(model, ["cpu"] * 3, buffers="average")
    wrapped(torch.randn(7, 3, 7, 7)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_bad_arguments_are_value_errors():
    with pytest.raises(ValueError, match="buffers policy 'mean'"):
        DataParallel(_model(), ["cpu"], buffers="mean")
    with pytest.raises(ValueError, match="'gpu:7'"):
        DataParallel(_model(), ["cpu", "gpu:7"])
    with pytest.raises(ValueError, match="ordinal"):
        DataParallel(_model(), ["cpu", -1])


def test_state_dict_has_plain_keys_and_loads_either_form():
    model = _bn_model()
    wrapped = DataParallel(model, ["cpu"] * 2)
    state = wrapped.state_dict()
    assert list(state) == list(model.state_dict())
    fresh = DataParallel(_bn_model(), ["cpu"] * 2)
    fresh.load_state_dict(state)
    prefixed = {"module." + k: v for k, v in state.items()}
    DataParallel(_bn_model(), ["cpu"] * 2).load_state_dict(prefixed)
    for k, v in fresh.module.state_dict().items():
        assert torch.equal(v, state[k])
    # nested inside another module the keys stay consistent both ways
    outer = nn.ModuleDict({"net": DataParallel(_bn_model(), ["cpu"] * 2)})
    nested = outer.state_dict()
    assert "net.0.weight" in nested
    outer.load_state_dict(nested)


def test_single_device_calls_the_module_directly():
    calls = []

    class Spy(nn.Linear):
        def forward(self, x):
            calls.append(x)
            return super().forward(x)

    model = Spy(3, 2)
    wrapped = DataParallel(model, ["cpu"])
    x = torch.randn(4, 3)
    wrapped(x)
    assert calls[0] is x  # no copy, no split
    assert wrapped.module is model and wrapped.device_ids == [torch.device("cpu")]
    assert wrapped.output_device == torch.device("cpu")


def test_kwargs_and_nested_outputs():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x, *, scale=1.0, mask=None):
            return {"y": self.lin(x) * scale * mask[:, None], "n": x.shape[1]}

    net = Net()
    x, mask = torch.randn(5, 3), torch.rand(5)
    out = DataParallel(net, ["cpu"] * 3)(x, scale=2.0, mask=mask)
    torch.testing.assert_close(out["y"], net(x, scale=2.0, mask=mask)["y"])
    assert out["n"] == 3


@pytest.mark.parametrize("n", [1, 2, 3])
def test_functional_data_parallel_matches(n):
    model = _model()
    x = torch.randn(5, 3, 8, 8)
    out = data_parallel(model, x, ["cpu"] * n)
    torch.testing.assert_close(out, model(x))
    out.sum().backward()
    grads = _grads(model)
    model.zero_grad()
    model(x).sum().backward()
    for g, r in zip(grads, _grads(model)):
        torch.testing.assert_close(g, r)


def test_replica_error_names_the_replica_and_keeps_its_type():
    class Picky(nn.Module):
        def forward(self, x):
            if x.shape[0] == 1:  # 7 rows over 4 replicas: 2, 2, 2, 1; only replica 3 fails
                raise IndexError("one row is too few")
            return x

    with pytest.raises(IndexError, match=r"replica 3 on cpu: one row is too few"):
        DataParallel(Picky(), ["cpu"] * 4)(torch.randn(7, 2))


def test_data_parallel_model_returns_per_device_outputs():
    from tandem.parallel import DataParallelModel

    model = _model()
    outs = DataParallelModel(model, ["cpu"] * 4)(torch.randn(3, 3, 8, 8))
    assert isinstance(outs, list) and [o.shape[0] for o in outs] == [1, 1, 1]
    single = DataParallelModel(model, ["cpu"])(torch.randn(3, 3, 8, 8))
    assert isinstance(single, list) and single[0].shape == (3, 5)


def test_module_moved_in_place_keeps_parameter_identity():
    model = _model()
    params = list(model.parameters())
    wrapped = DataParallel(model, ["cpu", "cpu"])
    assert all(a is b for a, b in zip(params, wrapped.module.parameters()))


@pytest.mark.cuda
def test_cuda_replicas_match_reference():
    model = _bn_model().eval()
    reference = copy.deepcopy(model)
    wrapped = DataParallel(model, ["cuda:0", "cuda:0", "cpu"], output_device="cpu")
    x = torch.randn(7, 3, 7, 7)
    out = wrapped(x)
    torch.testing.assert_close(out, reference(x), rtol=1e-4, atol=1e-5)
    out.sum().backward()
    reference(x).sum().backward()
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad.cpu(), r.grad, rtol=1e-4, atol=1e-5)


class _MeanOut(nn.Module):
    """Returns its per-sample rows and a scalar: their mean over the batch (or chunk)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x, per_sample=False):
        out = self.lin(x)
        return out if per_sample else (out, out.mean())


@pytest.mark.parametrize("n, batch", [(1, 7), (2, 7), (3, 7), (3, 2), (3, 1)])
def test_a_scalar_output_is_the_batch_s_value_or_refused(n, batch):
    """Chunks of 4 and 3 (2 replicas), of 3, 2 and 2, and a batch below the device count:
    where the scalar came from one chunk it is the plain model's; from several, whose mean is
    not the batch's, it is refused naming it. Per-sample outputs reduced after gathering, as
    the message says, match the plain model."""
    model = _MeanOut()
    reference = copy.deepcopy(model)
    wrapped = DataParallel(model, ["cpu"] * n)
    x = torch.randn(batch, 3) * 3 + 1
    chunks = min(n, batch)
    if chunks == 1:
        out, scalar = wrapped(x)
        ref_out, ref_scalar = reference(x)
        assert scalar.dim() == 0
        torch.testing.assert_close(scalar, ref_scalar)
    else:
        with pytest.raises(ValueError) as info:
            wrapped(x)
        message = str(info.value)
        error, _, hint = message.partition("\nhint: ")
        assert error.startswith(f"DataParallel: output[1] is a scalar on each of the "
                                f"{chunks} replicas") and "\n" not in error + hint
        assert "DataParallelModel + DataParallelCriterion" in message
        if (n, batch) == (2, 7):  # what torch returns instead, averaged: not the batch's mean
            per_replica = torch.stack([reference(c)[1] for c in x.split(4)])
            assert not torch.allclose(per_replica.mean(), reference(x)[1], atol=1e-3)
        out = wrapped(x, per_sample=True)
        ref_out = reference(x, per_sample=True)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(out.mean(), ref_out.mean())


def test_functional_data_parallel_refuses_scalars_too():
    model = _MeanOut()
    x = torch.randn(7, 3)
    with pytest.raises(ValueError, match=r"output\[1\] is a scalar on each of the 2 replicas"):
        data_parallel(model, x, ["cpu", "cpu"])
    torch.testing.assert_close(data_parallel(model, x, ["cpu"])[1], model(x)[1])
