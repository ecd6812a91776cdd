"""GroupParallelConv2d against nn.Conv2d(groups=g) on one device."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tandem.hybrid import GroupParallelConv2d
from tandem.parallel.traffic import TrafficMeter

ATOL = 1e-5


def cpus(n):
    return ["cpu"] * n


def test_forum_check_groups2_is_two_half_convs_concatenated():
    """A groups=2 conv equals two ordinary convs, each on half the channels, concatenated."""
    conv = nn.Conv2d(6, 8, 3, padding=1, groups=2)
    x = torch.randn(2, 6, 5, 5)
    halves = [F.conv2d(x[:, 3 * k:3 * (k + 1)], conv.weight[4 * k:4 * (k + 1)],
                       conv.bias[4 * k:4 * (k + 1)], padding=1) for k in range(2)]
    torch.testing.assert_close(conv(x), torch.cat(halves, 1), atol=ATOL, rtol=0)


@pytest.mark.parametrize("groups", [2, 4])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_matches_grouped_conv(groups, n):
    ref = nn.Conv2d(2 * groups, 3 * groups, 3, stride=2, padding=1, groups=groups)
    layer = GroupParallelConv2d.from_conv(ref, cpus(n))
    assert len(layer.shards) == min(n, groups)
    assert sorted(k for gs in layer.groups_of for k in gs) == list(range(groups))
    assert all(k % len(layer.shards) == j for j, gs in enumerate(layer.groups_of) for k in gs)

    x = torch.randn(3, 2 * groups, 7, 6, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = layer(x), ref(x_ref)
    torch.testing.assert_close(y, y_ref, atol=ATOL, rtol=0)

    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad, atol=ATOL, rtol=0)
    # gradients, reassembled in group order, equal the grouped conv's
    w_grad = layer._in_group_order([s.weight.grad for s in layer.shards], 0)
    b_grad = layer._in_group_order([s.bias.grad for s in layer.shards], 0)
    torch.testing.assert_close(w_grad, ref.weight.grad, atol=ATOL, rtol=0)
    torch.testing.assert_close(b_grad, ref.bias.grad, atol=ATOL, rtol=0)

    for params in (layer.parameters(), ref.parameters()):
        torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3).step()
    merged = layer.to_conv()
    torch.testing.assert_close(merged.weight, ref.weight, atol=ATOL, rtol=0)
    torch.testing.assert_close(merged.bias, ref.bias, atol=ATOL, rtol=0)


@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("n", [2, 3])
def test_round_trip_and_several_groups_share_one_conv(groups, n):
    ref = nn.Conv2d(4 * groups, 2 * groups, (3, 1), dilation=(1, 2), groups=groups, bias=False)
    layer = GroupParallelConv2d.from_conv(ref, cpus(n))
    for shard, gs in zip(layer.shards, layer.groups_of):
        assert shard.groups == len(gs)  # one grouped conv per device, however many groups
    back = layer.to_conv()
    assert back.groups == groups and back.bias is None
    assert torch.equal(back.weight, ref.weight)
    x = torch.randn(1, 4 * groups, 5, 5)
    torch.testing.assert_close(layer(x), ref(x), atol=ATOL, rtol=0)


def test_unbatched_input_and_padding_mode():
    ref = nn.Conv2d(4, 4, 3, padding=1, groups=2, padding_mode="reflect")
    layer = GroupParallelConv2d.from_conv(ref, cpus(2))
    x = torch.randn(4, 6, 6)
    torch.testing.assert_close(layer(x), ref(x), atol=ATOL, rtol=0)


def test_traffic_is_the_other_shards_channels():
    ref = nn.Conv2d(4, 6, 1, groups=2)
    layer = GroupParallelConv2d.from_conv(ref, cpus(2))
    x = torch.randn(2, 4, 3, 3)
    with TrafficMeter() as meter:
        layer(x)
    # shard 1 gets 2 of the 4 input channels and sends back 3 of the 6 output channels
    assert meter.by_kind["activations"] == (2 * 2 * 9 + 2 * 3 * 9) * 4


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="nn.Conv2d"):
        GroupParallelConv2d.from_conv(nn.Linear(2, 2), cpus(2))
    layer = GroupParallelConv2d.from_conv(nn.Conv2d(4, 4, 1, groups=2), cpus(2))
    with pytest.raises(ValueError, match=r"\(N, 4, H, W\)"):
        layer(torch.randn(1, 3, 2, 2))


@pytest.mark.cuda
def test_mixed_devices():
    ref = nn.Conv2d(8, 12, 3, padding=1, groups=4)
    layer = GroupParallelConv2d.from_conv(ref, ["cuda:0", "cpu", "cuda:0"], output_device="cpu")
    x = torch.randn(2, 8, 5, 5, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = layer(x), ref(x_ref)
    torch.testing.assert_close(y, y_ref, atol=1e-4, rtol=1e-4)
    y.sum().backward()
    y_ref.sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(layer.to_conv().weight, ref.weight)
