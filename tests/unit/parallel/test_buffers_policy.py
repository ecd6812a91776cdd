"""The buffer policies: unit level, and through DataParallel against hand-computed statistics."""

import copy

import pytest
import torch
from torch import nn

from tandem.parallel import DataParallel, convert_sync_batchnorm, replicate
from tandem.parallel.buffers import check_policy, sync_buffers


class Stats(nn.Module):
    """Buffers a test can set per replica: a float, an integer counter and an untouched one."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.zeros(3))
        self.register_buffer("steps", torch.tensor(0))
        self.register_buffer("fixed", torch.full((2,), 0.1))


def _replicas_with(values, steps):
    module = Stats()
    replicas = replicate(module, ["cpu"] * len(values))
    for r, v, s in zip(replicas, values, steps):
        r.mean.fill_(v)
        r.steps.fill_(s)
    return module, replicas


def test_check_policy():
    assert check_policy("average") == "average"
    for bad in ["mean", "", None, "Replica0"]:
        with pytest.raises(ValueError, match="unknown buffers policy"):
            check_policy(bad)


def test_average_weights_by_chunk_size_and_keeps_integer_counts_of_replica_zero():
    module, replicas = _replicas_with([1.0, 4.0, 10.0], [5, 6, 7])
    sync_buffers(module, replicas, [2, 1, 1], "average")
    torch.testing.assert_close(module.mean, torch.full((3,), (2 * 1 + 4 + 10) / 4))
    assert module.steps.item() == 5
    assert torch.equal(module.fixed, torch.full((2,), 0.1))


def test_equal_buffers_stay_bit_exact_under_average():
    module, replicas = _replicas_with([0.1] * 3, [1] * 3)
    expected = module.mean.clone()
    sync_buffers(module, replicas, [3, 2, 2], "average")
    assert torch.equal(module.mean, expected)
    assert torch.equal(module.fixed, torch.full((2,), 0.1))


def test_replica0_keeps_replica_zero_even_when_it_is_a_copy():
    module = Stats()
    replicas = replicate(module, ["cpu"] * 2)[1:]  # no home replica among them
    replicas[0].mean.fill_(2.5)
    replicas[0].steps.fill_(9)
    sync_buffers(module, replicas, [1], "replica0")
    assert module.mean.eq(2.5).all() and module.steps.item() == 9


def _bn_net():
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 4 * 4, 2))


@pytest.mark.parametrize("n", [2, 3])
def test_policies_over_several_steps_match_hand_computed_running_means(n):
    base = _bn_net()
    by_policy = {p: copy.deepcopy(base) for p in ("replica0", "average")}
    wrapped = {p: DataParallel(m, ["cpu"] * n, buffers=p) for p, m in by_policy.items()}
    expected = {p: base[1].running_mean.clone() for p in by_policy}
    for step in range(3):
        x = torch.randn(5 + step, 3, 6, 6)
        sizes = [len(c) for c in torch.tensor_split(x, n)]
        sizes.sort(reverse=True)
        with torch.no_grad():  # the conv is shared, chunk means by hand
            means = [base[0](c).mean(dim=(0, 2, 3)) for c in torch.split(x, sizes)]
        expected["replica0"] = 0.9 * expected["replica0"] + 0.1 * means[0]
        full = sum(s * m for s, m in zip(sizes, means)) / sum(sizes)
        expected["average"] = 0.9 * expected["average"] + 0.1 * full
        for policy, w in wrapped.items():
            w(x).sum().backward()
            torch.testing.assert_close(by_policy[policy][1].running_mean, expected[policy])
            assert by_policy[policy][1].num_batches_tracked.item() == step + 1


@pytest.mark.parametrize("policy", ["replica0", "average"])
def test_sync_batchnorm_buffers_are_full_batch_under_any_policy(policy):
    base = _bn_net()
    reference = copy.deepcopy(base)
    model = convert_sync_batchnorm(copy.deepcopy(base))
    wrapped = DataParallel(model, ["cpu"] * 3, buffers=policy)
    x = torch.randn(7, 3, 6, 6)
    torch.testing.assert_close(wrapped(x), reference(x), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(model[1].running_mean, reference[1].running_mean)
    torch.testing.assert_close(model[1].running_var, reference[1].running_var)
    assert model[1].num_batches_tracked.item() == 1
