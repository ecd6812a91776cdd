"""SyncBatchNorm between replica threads (own harness), plain-BN equivalence, conversion."""

import copy
import inspect

import pytest
import torch
from replica_threads import run_threads
from torch import nn

from tandem.parallel import context
from tandem.parallel.context import ReplicaAborted, ReplicaContext, ReplicaGroup
from tandem.parallel.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm
from tandem.parallel.sync_functions import local_moments, merge_moments

CPU = torch.device("cpu")
PLAIN = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}
HAS_BIAS_FLAG = "bias" in inspect.signature(nn.BatchNorm2d.__init__).parameters  # torch >= 2.13
NO_BIAS = pytest.param(dict(bias=False), id="bias=False",
                       marks=pytest.mark.skipif(not HAS_BIAS_FLAG, reason="torch < 2.13"))


def replica_of(module):
    """A shallow copy sharing parameters but owning cloned buffers (like a replicate())."""
    rep = copy.copy(module)
    rep._parameters = dict(module._parameters)
    rep._buffers = {k: None if b is None else b.clone() for k, b in module._buffers.items()}
    rep._modules = dict(module._modules)
    return rep


def make_input(dims, n, channels=3, **kw):
    """(n, channels, ...) data with mean 0.5 and std 2, for BatchNorm1d/2d/3d shapes."""
    shape = {2: (n, channels), 3: (n, channels, 5), 4: (n, channels, 3, 4),
             5: (n, channels, 2, 3, 2)}[dims]
    return torch.randn(shape, **kw) * 2 + 0.5


def plain_like(bn, dims):
    """nn.BatchNorm{1,2,3}d with bn's options and a copy of its state."""
    no_bias = {"bias": False} if bn.affine and bn.bias is None else {}  # needs torch >= 2.13
    ref = PLAIN[dims](bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats,
                      **no_bias)
    ref.load_state_dict(bn.state_dict())
    return ref


def step_plain(ref, x, w):
    """One forward/backward of plain BatchNorm on the whole batch."""
    ref.zero_grad()
    xx = x.detach().clone().requires_grad_()
    out = ref(xx)
    (out * w).sum().backward()
    return out, xx.grad


def step_threads(bn, x, w, sizes, separate_buffers):
    """One forward over replica threads (one chunk each) and ONE backward of the summed loss."""
    bn.zero_grad()
    mods = [replica_of(bn) if separate_buffers else bn for _ in sizes]
    xs = [c.detach().clone().requires_grad_() for c in x.split(sizes)]
    outs, errors = run_threads([lambda m=m, c=c: m(c) for m, c in zip(mods, xs)])
    assert errors == [None] * len(sizes), errors
    torch.cat(outs).mul(w).sum().backward()  # replicas share one autograd thread here
    return mods, torch.cat(outs), torch.cat([c.grad for c in xs])


def assert_same_step(bn, ref, mods, got, want, steps=1):
    close = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[0], want[0], **close)  # output
    torch.testing.assert_close(got[1], want[1], **close)  # input grad
    for name in ("weight", "bias"):
        if getattr(ref, name) is not None:
            torch.testing.assert_close(getattr(bn, name).grad, getattr(ref, name).grad, **close)
    if ref.track_running_stats:
        for m in mods:  # every replica holds the full-batch running stats, counted once
            torch.testing.assert_close(m.running_mean, ref.running_mean, **close)
            torch.testing.assert_close(m.running_var, ref.running_var, **close)
            assert m.num_batches_tracked.item() == ref.num_batches_tracked.item() == steps
    else:
        assert all(m.running_mean is None for m in mods)


def randomize(bn):
    with torch.no_grad():
        if bn.weight is not None:
            bn.weight.uniform_(0.5, 1.5)
        if bn.bias is not None:
            bn.bias.uniform_(-1, 1)
    return bn


@pytest.mark.parametrize("dims", [2, 3, 4, 5])
@pytest.mark.parametrize("sizes", [[3, 5], [1, 4, 2], [2, 1, 3, 1], [4, 0, 3]])
@pytest.mark.parametrize("separate_buffers", [False, True])
def test_threads_match_whole_batch(dims, sizes, separate_buffers):
    bn = randomize(SyncBatchNorm(3, momentum=0.3))
    ref = plain_like(bn, dims)
    x = make_input(dims, sum(sizes))
    w = torch.randn_like(x)
    want = step_plain(ref, x, w)
    mods, *got = step_threads(bn, x, w, sizes, separate_buffers)
    assert_same_step(bn, ref, mods, got, want)


@pytest.mark.parametrize("kw", [dict(momentum=None), dict(affine=False),
                                dict(track_running_stats=False), NO_BIAS])
def test_threads_options_over_steps(kw):
    sizes, dims = [2, 5, 3], 4
    bn = randomize(SyncBatchNorm(3, **kw))
    ref = plain_like(bn, dims)
    for step in range(1, 4):
        x = make_input(dims, sum(sizes))
        w = torch.randn_like(x)
        want = step_plain(ref, x, w)
        mods, *got = step_threads(bn, x, w, sizes, separate_buffers=True)
        assert_same_step(bn, ref, mods, got, want, steps=step)
        bn.load_state_dict(mods[0].state_dict())  # replica 0's buffers back (all are equal)


# --- plain BatchNorm wherever there is nothing to synchronize -------------------------------


@pytest.mark.parametrize("dims", [2, 3, 4, 5])
@pytest.mark.parametrize("kw", [dict(), dict(momentum=None), dict(track_running_stats=False),
                                dict(affine=False)])
def test_plain_batchnorm_bit_for_bit(dims, kw):
    """Outside a context, in a one-replica context, and in eval mode: exactly nn.BatchNorm."""
    bn = randomize(SyncBatchNorm(3, **kw))
    ref = plain_like(bn, dims)
    for mode in ("train", "train", "eval"):
        bn.train(mode == "train")
        ref.train(mode == "train")
        x = make_input(dims, 4)
        w = torch.randn_like(x)
        want = step_plain(ref, x, w)
        got = step_plain(bn, x, w)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        group = ReplicaGroup([CPU])
        with context.use(ReplicaContext(0, CPU, group)):
            assert torch.equal(bn(x), ref(x))
    for (name, a), (_, b) in zip(bn.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), name


def test_eval_mode_in_threads_uses_running_stats_without_meeting():
    bn = randomize(SyncBatchNorm(3))
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
    bn.eval()
    ref = plain_like(bn, 4)
    ref.eval()
    x = make_input(4, 5)
    # Replica 1 never calls the layer: a rendezvous would time out, eval mode must not meet.
    outs, errors = run_threads([lambda: bn(x[:2]), lambda: None], timeout=5)
    assert errors == [None, None]
    assert torch.equal(outs[0], ref(x[:2]))


# --- numerics -----------------------------------------------------------------------------


def test_merge_keeps_precision_when_mean_dwarfs_spread():
    """sum/sumsq in float32 would lose the variance of 1e4 + N(0, 1) entirely."""
    x = torch.randn(4096, 2, dtype=torch.float64) + 1e4
    parts = torch.stack([local_moments(c.float()) for c in x.split([1000, 96, 3000])])
    n, mean, m2 = merge_moments(parts)
    assert n.tolist() == [4096.0, 4096.0]
    torch.testing.assert_close(mean.double(), x.mean(0), rtol=1e-7, atol=0)
    torch.testing.assert_close((m2 / n).double(), x.var(0, correction=0), rtol=1e-3, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_merge_in_float64(dtype):
    sizes = [3, 4]
    x = make_input(4, sum(sizes)).to(dtype)
    assert local_moments(x).dtype == torch.float64
    bn = randomize(SyncBatchNorm(3))
    ref = plain_like(bn, 4).double()
    w = torch.randn(x.shape, dtype=torch.float64)
    want = step_plain(ref, x.double(), w)
    mods, out, grad = step_threads(bn, x, w.to(dtype), sizes, separate_buffers=False)
    assert out.dtype == dtype and grad.dtype == dtype
    tol = dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.double(), want[0], **tol)
    torch.testing.assert_close(grad.double(), want[1], **tol)
    torch.testing.assert_close(bn.running_var.double(), ref.running_var, rtol=1e-3, atol=1e-3)


# --- rendezvous behaviour -----------------------------------------------------------------


def test_layer_called_twice_pairs_calls_in_order():
    bn = randomize(SyncBatchNorm(3, momentum=None))
    ref = plain_like(bn, 2)
    x = make_input(2, 7)
    sizes = [3, 4]

    def twice(c):
        return bn(bn(c) * 2 + 1)

    outs, errors = run_threads([lambda c=c: twice(c) for c in x.split(sizes)])
    assert errors == [None, None]
    torch.testing.assert_close(torch.cat(outs), ref(ref(x) * 2 + 1), rtol=1e-5, atol=1e-5)
    assert bn.num_batches_tracked.item() == 2
    torch.testing.assert_close(bn.running_var, ref.running_var)


def test_failing_replica_wakes_the_waiting_one():
    """Replica 1 fails before its SyncBatchNorm; replica 0 waits there and must not hang."""
    bn = SyncBatchNorm(3)
    x = make_input(4, 4)

    def broken():
        raise KeyError("replica 1 broke")

    _, errors = run_threads([lambda: bn(x[:2]), broken], timeout=20)
    assert isinstance(errors[1], KeyError)
    assert isinstance(errors[0], ReplicaAborted) and "KeyError" in str(errors[0])


def test_global_batch_of_one_value_raises_like_batchnorm():
    bn = SyncBatchNorm(3)
    x = make_input(2, 1)
    _, errors = run_threads([lambda: bn(x), lambda: bn(x[:0])])
    # The replica that merges raises; the other is woken with ReplicaAborted naming it.
    kinds = sorted(type(e).__name__ for e in errors)
    assert kinds == ["ReplicaAborted", "ValueError"], errors
    assert "more than 1 value per channel" in str(errors[0]) + str(errors[1])
    with pytest.raises(ValueError):
        nn.BatchNorm1d(3)(x)


def test_channel_mismatch_is_a_clear_error():
    with pytest.raises(ValueError, match="SyncBatchNorm\\(3\\) got an input with 4 channels"):
        SyncBatchNorm(3)(torch.randn(2, 4))
    with pytest.raises(ValueError, match="expects an \\(N, C, ...\\) input"):
        SyncBatchNorm(3)(torch.randn(3))


# --- convert_sync_batchnorm ---------------------------------------------------------------


def small_net():
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Sequential(nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4, momentum=None, affine=False)),
        nn.Flatten(), nn.Linear(4 * 16, 6), nn.BatchNorm1d(6, track_running_stats=False),
    )


def test_convert_keeps_state_and_tensors():
    net = small_net()
    net(torch.randn(5, 3, 4, 4))  # non-trivial running stats
    net[1].weight.requires_grad_(False)
    net[3].eval()
    state = {k: v.clone() for k, v in net.state_dict().items()}
    tensors = {k: v for k, v in net.state_dict(keep_vars=True).items()}
    converted = convert_sync_batchnorm(net)
    assert converted is net
    assert [type(m) for m in net.modules()].count(SyncBatchNorm) == 3
    assert not any(type(m) in PLAIN.values() for m in net.modules())
    new_state = net.state_dict(keep_vars=True)
    assert list(new_state) == list(state)
    for k, v in new_state.items():
        assert v is tensors[k], k  # the very same tensors: optimizers keep working
        assert torch.equal(v, state[k]), k
    assert not net[1].weight.requires_grad and net[1].bias.requires_grad
    assert net[1].training and not net[3][1].training
    assert net[3][1].momentum is None and not net[3][1].affine
    assert not net[6].track_running_stats

    fresh = small_net()
    fresh.load_state_dict(state)  # the original model, reloaded, computes the same thing
    fresh.eval(), net.eval()
    x = torch.randn(3, 3, 4, 4)
    assert torch.equal(fresh(x), net(x))


def test_convert_root_batchnorm_and_process_group():
    bn = nn.BatchNorm3d(2, eps=1e-3, momentum=0.2, dtype=torch.float64)
    bn(torch.randn(3, 2, 2, 2, 2, dtype=torch.float64))
    marker = object()
    sync = convert_sync_batchnorm(bn, process_group=marker)
    assert isinstance(sync, SyncBatchNorm) and sync is not bn
    assert sync.process_group is marker and sync.eps == 1e-3 and sync.momentum == 0.2
    assert sync.running_mean is bn.running_mean and sync.weight is bn.weight
    assert sync.weight.dtype == torch.float64
    assert convert_sync_batchnorm(sync) is sync
    assert isinstance(convert_sync_batchnorm(nn.SyncBatchNorm(2)), SyncBatchNorm)


# --- CUDA (run on a GPU machine; skipped here) --------------------------------------------


def cuda_layouts():
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    layouts = [["cuda:0", "cuda:0"], ["cuda:0", "cpu", "cuda:0"]]
    if n >= 2:
        layouts.append([f"cuda:{i}" for i in range(n)])
    return layouts


def replica_on(module, device):
    """A replica on ``device``: differentiable copies of the parameters, cloned buffers."""
    rep = copy.copy(module)
    rep._parameters = {k: None if p is None else p.to(device) for k, p in module._parameters.items()}
    rep._buffers = {k: None if b is None else b.to(device, copy=True)
                    for k, b in module._buffers.items()}
    return rep


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cuda_replica_threads_match_whole_batch(dtype):
    for layout in cuda_layouts():
        devices = [torch.device(d) for d in layout]
        sizes = [3, 1, 4, 2][: len(devices)]
        x = make_input(4, sum(sizes)).to(dtype).double()  # what the replicas will see
        w = torch.randn_like(x)
        bn = randomize(SyncBatchNorm(3)).to(devices[0])
        ref = plain_like(bn, 4).double().cpu()
        want = step_plain(ref, x, w)
        mods = [replica_on(bn, d) for d in devices]
        xs = [c.to(d, dtype).requires_grad_() for c, d in zip(x.split(sizes), devices)]
        outs, errors = run_threads([lambda m=m, c=c: m(c) for m, c in zip(mods, xs)],
                                   devices=devices)
        assert errors == [None] * len(devices), errors
        loss = sum((o.double().cpu() * wc).sum() for o, wc in zip(outs, w.split(sizes)))
        loss.backward()
        tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=3e-2)
        out = torch.cat([o.double().cpu() for o in outs])
        grad = torch.cat([c.grad.double().cpu() for c in xs])
        torch.testing.assert_close(out, want[0], **tol)
        torch.testing.assert_close(grad, want[1], **tol)
        torch.testing.assert_close(bn.weight.grad.double().cpu(), ref.weight.grad, **tol)
        torch.testing.assert_close(bn.bias.grad.double().cpu(), ref.bias.grad, **tol)
        for m in mods:
            assert m.running_mean.device == m.weight.device  # buffers stay on their device
            torch.testing.assert_close(m.running_var.double().cpu(), ref.running_var,
                                       rtol=1e-4, atol=1e-4)
            assert m.num_batches_tracked.item() == 1


@pytest.mark.cuda
def test_cuda_single_device_and_eval_are_plain_batchnorm():
    bn = randomize(SyncBatchNorm(3)).cuda()
    ref = plain_like(bn, 4).cuda()
    for train in (True, False):
        bn.train(train), ref.train(train)
        x = make_input(4, 6, device="cuda")
        w = torch.randn_like(x)
        want, got = step_plain(ref, x, w), step_plain(bn, x, w)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(bn.running_var, ref.running_var)
