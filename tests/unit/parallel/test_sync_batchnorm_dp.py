"""SyncBatchNorm inside tandem.parallel.DataParallel / DataParallelModel vs one device."""

import copy
import threading

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tandem.parallel import (
    DataParallel,
    DataParallelCriterion,
    DataParallelModel,
    SyncBatchNorm,
    context,
    convert_sync_batchnorm,
)

# float64 throughout, so that "equal to one device" is tested to ~1e-10, not to float32 noise
# (batch norm over 2 samples amplifies rounding differences between summation orders).
close = dict(rtol=1e-9, atol=1e-10)


def conv_net():
    """A small conv net with every kind of batch norm: 2d (both momenta) and 1d on features."""
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Conv2d(4, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6, momentum=None), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 5), nn.BatchNorm1d(5),
    )


def data(batch, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, 5, 5, generator=g, dtype=dtype) * 2 + 1
    return x, torch.randint(0, 5, (batch,), generator=g)


def train(model, forward, steps, batches):
    """SGD steps; returns the last output, input grad and the grads before the last step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    for step in range(steps):
        x, y = data(batches[step % len(batches)], seed=step)
        x.requires_grad_()
        opt.zero_grad()
        out, loss = forward(x, y)
        loss.backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
    return out.detach(), x.grad, grads


def whole_batch(model):
    return lambda x, y: (lambda out: (out, F.cross_entropy(out, y)))(model(x))


def assert_same(got, want, model, ref):
    out, xgrad, grads = got
    torch.testing.assert_close(out, want[0], **close)
    torch.testing.assert_close(xgrad, want[1], **close)
    for k, g in grads.items():
        torch.testing.assert_close(g, want[2][k], **close, msg=lambda m: f"grad {k}: {m}")
    ref_state = ref.state_dict()  # parameters after the steps, running stats, counters
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, ref_state[k], **close, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("policy", ["replica0", "average"])
@pytest.mark.parametrize("n, batches", [(2, [7, 4]), (3, [8, 5, 2]), (4, [11, 3, 6])],
                         ids=["2cpu", "3cpu", "4cpu"])
def test_data_parallel_matches_one_device(n, batches, policy):
    """Uneven chunks, a batch smaller than the device count, several steps, both policies."""
    torch.manual_seed(0)
    ref = conv_net().double()
    model = convert_sync_batchnorm(copy.deepcopy(ref))
    assert sum(isinstance(m, SyncBatchNorm) for m in model.modules()) == 3
    wrapped = DataParallel(model, ["cpu"] * n, buffers=policy)
    steps = 3
    want = train(ref, whole_batch(ref), steps, batches)
    got = train(model, whole_batch(wrapped), steps, batches)
    assert_same(got, want, model, ref)
    assert model[4].num_batches_tracked.item() == steps  # once per forward, not per replica


@pytest.mark.parametrize("n", [2, 3])
def test_data_parallel_model_with_per_device_losses(n):
    """DataParallelModel: each device's loss share where its output lives, summed."""
    torch.manual_seed(0)
    ref = conv_net().double()
    model = convert_sync_batchnorm(copy.deepcopy(ref))
    wrapped = DataParallelModel(model, ["cpu"] * n, buffers="average")

    def forward(x, y):
        outs = wrapped(x)
        targets = y.split([o.shape[0] for o in outs])
        loss = sum(F.cross_entropy(o, t, reduction="sum") for o, t in zip(outs, targets))
        return torch.cat(outs), loss / x.shape[0]

    batches = [7, 2]
    want = train(ref, whole_batch(ref), 2, batches)
    got = train(model, forward, 2, batches)
    assert_same(got, want, model, ref)


def test_data_parallel_criterion():
    torch.manual_seed(0)
    ref = conv_net().double()
    model = convert_sync_batchnorm(copy.deepcopy(ref))
    wrapped = DataParallelModel(model, ["cpu"] * 3)
    criterion = DataParallelCriterion(nn.CrossEntropyLoss(), ["cpu"] * 3)

    def forward(x, y):
        outs = wrapped(x)
        return torch.cat(outs), criterion(outs, y)

    want = train(ref, whole_batch(ref), 2, [8, 5])
    got = train(model, forward, 2, [8, 5])
    assert_same(got, want, model, ref)


def test_eval_mode_in_data_parallel_uses_running_stats():
    torch.manual_seed(0)
    ref = conv_net().double()
    train(ref, whole_batch(ref), 1, [6])
    model = convert_sync_batchnorm(copy.deepcopy(ref)).eval()
    ref.eval()
    x, _ = data(5)
    torch.testing.assert_close(DataParallel(model, ["cpu"] * 3)(x), ref(x), **close)


class FailOnReplica(nn.Module):
    """Raises in replica ``index`` before the rest of the model runs."""

    def __init__(self, index):
        super().__init__()
        self.index = index

    def forward(self, x):
        replica = context.current()
        if replica is not None and replica.index == self.index:
            raise KeyError(f"planted failure in replica {self.index}")
        return x


def test_failing_replica_raises_instead_of_hanging():
    """Replica 1 fails before its SyncBatchNorm while replica 0 waits there for it."""
    torch.manual_seed(0)
    net = convert_sync_batchnorm(nn.Sequential(nn.Conv2d(3, 4, 3), FailOnReplica(1),
                                               nn.BatchNorm2d(4)))
    wrapped = DataParallel(net, ["cpu"] * 3)
    x, _ = data(6, dtype=torch.float32)
    outcome = {}

    def run():
        try:
            wrapped(x)
        except BaseException as exc:  # noqa: BLE001 - inspected below
            outcome["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(60)  # the rendezvous would wait 300 s if nobody woke replica 0
    assert not t.is_alive(), "DataParallel hung on a failed replica"
    error = outcome.get("error")
    assert isinstance(error, KeyError), repr(error)  # the real error, not ReplicaAborted
    assert "replica 1 on cpu" in str(error) and "planted failure" in str(error)

    net[1].index = -1  # the next step works: no rendezvous state survives a failure
    out = wrapped(x)
    assert out.shape == (6, 4, 3, 3)
    assert net[2].num_batches_tracked.item() == 1  # the failed step updated nothing


@pytest.mark.cuda
@pytest.mark.parametrize("policy", ["replica0", "average"])
def test_cuda_data_parallel_matches_one_device(policy):
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    n = max(2, torch.cuda.device_count())
    devices = [f"cuda:{i % torch.cuda.device_count()}" for i in range(n)]
    torch.manual_seed(0)
    ref = conv_net()
    model = convert_sync_batchnorm(copy.deepcopy(ref))
    wrapped = DataParallel(model, devices, buffers=policy)
    batches = [7, 2]

    def forward(x, y):
        out = wrapped(x.float().cuda())
        return out.cpu(), F.cross_entropy(out, y.cuda())

    want = train(ref, lambda x, y: whole_batch(ref)(x.float(), y), 2, batches)
    got = train(model, forward, 2, batches)
    model.cpu()
    tol = dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[0], want[0], **tol)
    torch.testing.assert_close(got[1], want[1], **tol)
    ref_state = ref.state_dict()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, ref_state[k], **tol, msg=lambda m: f"{k}: {m}")
