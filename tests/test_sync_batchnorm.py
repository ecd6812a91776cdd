"""SyncBatchNorm between replica threads (own harness), plain-BN equivalence, conversion."""

import copy
import threading

import pytest
import torch
from torch import nn

from tandem.parallel import context
from tandem.parallel.context import ReplicaAborted, ReplicaContext, ReplicaGroup
from tandem.parallel.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm
from tandem.parallel.sync_functions import local_moments, merge_moments

CPU = torch.device("cpu")
PLAIN = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}


def run_threads(fns, timeout=60.0, devices=None):
    """Run fns[i]() in thread i under ReplicaContext(i); abort the group when one fails."""
    group = ReplicaGroup(devices or [CPU] * len(fns), timeout=timeout)
    results, errors = [None] * len(fns), [None] * len(fns)

    def work(i):
        try:
            with context.use(ReplicaContext(i, group.devices[i], group)):
                results[i] = fns[i]()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            errors[i] = exc
            group.abort(exc)

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a replica thread hung"
    return results, errors


def replica_of(module):
    """A shallow copy sharing parameters but owning cloned buffers (like a replicate())."""
    rep = copy.copy(module)
    rep._parameters = dict(module._parameters)
    rep._buffers = {k: None if b is None else b.clone() for k, b in module._buffers.items()}
    rep._modules = dict(module._modules)
    return rep


def make_input(dims, n, channels=3, **kw):
    shape = {2: (n, channels), 3: (n, channels, 5), 4: (n, channels, 3, 4),
             5: (n, channels, 2, 3, 2)}[dims]
    return torch.randn(shape, **kw) * 2 + 0.5


def plain_like(bn, dims):
    """nn.BatchNorm{1,2,3}d with bn's options and a copy of its state."""
    ref = PLAIN[dims](bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats,
                      bias=bn.bias is not None or not bn.affine)
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
                                dict(track_running_stats=False), dict(bias=False)])
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
