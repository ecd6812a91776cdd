"""ColumnParallelLinear / RowParallelLinear / Shardwise against one nn.Linear on one device."""

import pytest
import torch
from torch import nn

from tandem.hybrid import ColumnParallelLinear, RowParallelLinear, Shardwise
from tandem.parallel.traffic import TrafficMeter

DEVICES = [1, 2, 3, 4]
ATOL = 1e-5


def cpus(n):
    return ["cpu"] * n


def sgd_step(params, lr=0.1):
    opt = torch.optim.SGD(params, lr=lr, momentum=0.9)
    opt.step()


def column_grads(layer):
    w = torch.cat([s.weight.grad for s in layer.shards], 0)
    b = torch.cat([s.bias.grad for s in layer.shards], 0)
    return w, b


@pytest.mark.parametrize("n", DEVICES)
@pytest.mark.parametrize("out_features", [10, 2])
@pytest.mark.parametrize("gather", [True, False])
def test_column_matches_linear(n, out_features, gather):
    ref = nn.Linear(7, out_features)
    layer = ColumnParallelLinear.from_linear(ref, cpus(n), gather_output=gather)
    expected = {(10, 1): [10], (10, 2): [5, 5], (10, 3): [4, 3, 3], (10, 4): [3, 3, 2, 2]}
    assert layer.sizes == expected.get((out_features, n), [1, 1] if n > 1 else [2])
    assert len(layer.shards) == min(n, out_features)
    x = torch.randn(5, 7, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()

    y = layer(x)
    if not gather:
        assert isinstance(y, list) and [t.shape[-1] for t in y] == layer.sizes
        y = torch.cat(y, -1)
    y_ref = ref(x_ref)
    torch.testing.assert_close(y, y_ref, atol=ATOL, rtol=0)

    g = torch.randn_like(y_ref)
    y.backward(g)
    y_ref.backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad, atol=ATOL, rtol=0)
    w, b = column_grads(layer)
    torch.testing.assert_close(w, ref.weight.grad, atol=ATOL, rtol=0)
    torch.testing.assert_close(b, ref.bias.grad, atol=ATOL, rtol=0)

    sgd_step(layer.parameters())
    sgd_step(ref.parameters())
    merged = layer.to_linear()
    torch.testing.assert_close(merged.weight, ref.weight, atol=ATOL, rtol=0)
    torch.testing.assert_close(merged.bias, ref.bias, atol=ATOL, rtol=0)


def test_column_uneven_split_and_own_parameters():
    ref = nn.Linear(4, 10)
    layer = ColumnParallelLinear.from_linear(ref, cpus(3))
    assert layer.sizes == [4, 3, 3]
    params = list(layer.parameters())
    assert len(params) == 6 and all(p is not ref.weight and p is not ref.bias for p in params)
    # the original is copied, never aliased: changing the split layer leaves it alone
    before = ref.weight.detach().clone()
    with torch.no_grad():
        layer.shards[0].weight.add_(1.0)
    torch.testing.assert_close(ref.weight, before)


@pytest.mark.parametrize("n", DEVICES)
def test_round_trip(n):
    ref = nn.Linear(6, 9)
    for cls in (ColumnParallelLinear, RowParallelLinear):
        back = cls.from_linear(ref, cpus(n)).to_linear()
        assert torch.equal(back.weight, ref.weight) and torch.equal(back.bias, ref.bias)
    nobias = nn.Linear(6, 9, bias=False)
    assert ColumnParallelLinear.from_linear(nobias, cpus(n)).to_linear().bias is None
    assert RowParallelLinear.from_linear(nobias, cpus(n)).to_linear().bias is None


@pytest.mark.parametrize("n", DEVICES)
def test_row_takes_whole_tensor(n):
    ref = nn.Linear(10, 3)
    layer = RowParallelLinear.from_linear(ref, cpus(n))
    x = torch.randn(4, 10)
    torch.testing.assert_close(layer(x), ref(x), atol=ATOL, rtol=0)
    shapes = [tuple(p.shape) for p in layer.parameters()]
    assert shapes.count((3,)) == 1 and len(shapes) == len(layer.shards) + 1  # bias held once


@pytest.mark.parametrize("n", [2, 3])
def test_row_under_autocast_gives_linears_dtype_and_sums_in_float32(n):
    """Under bf16 autocast nn.Linear returns bf16, summed in float32 inside its matmul; the
    row-parallel layer returns bf16 too (it returned float32, its bias promoting a bf16 sum
    of bf16 partials) and sums its partials in float32: within one bf16 rounding of a float32
    sum of the same bf16 partials, and of nn.Linear's output."""
    torch.manual_seed(0)
    ref = nn.Linear(96, 5)
    layer = RowParallelLinear.from_linear(ref, cpus(n))
    x = torch.randn(8, 96) * 30
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, want = layer(x), ref(x)
        parts = [s(b) for s, b in zip(layer.shards, torch.split(x, layer.sizes, -1))]
    assert out.dtype == want.dtype == torch.bfloat16
    exact = sum(p.float() for p in parts) + ref.bias
    torch.testing.assert_close(out, exact.to(torch.bfloat16), atol=0, rtol=0)
    torch.testing.assert_close(out.float(), want.float(), atol=0.5, rtol=2 ** -7)

@pytest.mark.parametrize("n", DEVICES)
@pytest.mark.parametrize("hidden", [10, 3])
def test_column_row_pair_matches_mlp(n, hidden):
    ref = nn.Sequential(nn.Linear(6, hidden), nn.ReLU(), nn.Dropout(0.0), nn.Linear(hidden, 4))
    col = ColumnParallelLinear.from_linear(ref[0], cpus(n), gather_output=False)
    row = RowParallelLinear.from_linear(ref[3], cpus(n))
    assert row.sizes == col.sizes
    mlp = nn.Sequential(col, Shardwise(nn.ReLU(), nn.Dropout(0.0)), row)

    x = torch.randn(5, 6, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = mlp(x), ref(x_ref)
    torch.testing.assert_close(y, y_ref, atol=ATOL, rtol=0)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad, atol=ATOL, rtol=0)
    w, b = column_grads(col)
    torch.testing.assert_close(w, ref[0].weight.grad, atol=ATOL, rtol=0)
    torch.testing.assert_close(b, ref[0].bias.grad, atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat([s.weight.grad for s in row.shards], 1),
                               ref[3].weight.grad, atol=ATOL, rtol=0)
    torch.testing.assert_close(row.bias.grad, ref[3].bias.grad, atol=ATOL, rtol=0)

    sgd_step(mlp.parameters())
    sgd_step(ref.parameters())
    for merged, orig in ((col.to_linear(), ref[0]), (row.to_linear(), ref[3])):
        torch.testing.assert_close(merged.weight, orig.weight, atol=ATOL, rtol=0)
        torch.testing.assert_close(merged.bias, orig.bias, atol=ATOL, rtol=0)


def test_shardwise_dropout_uses_one_mask_per_shard():
    """Training-mode dropout: each shard draws its own mask, in shard order, from its device's
    generator. Rebuilding those masks by hand gives exactly the layer's output."""
    ref = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 4))
    col = ColumnParallelLinear.from_linear(ref[0], cpus(3), gather_output=False)
    row = RowParallelLinear.from_linear(ref[2], cpus(3))
    mlp = nn.Sequential(col, Shardwise(nn.ReLU(), nn.Dropout(0.5)), row).train()
    x = torch.randn(8, 6)
    torch.manual_seed(123)
    y = mlp(x)
    torch.manual_seed(123)
    mask = torch.cat([nn.functional.dropout(torch.ones(8, s), 0.5) for s in col.sizes], 1)
    assert 0 < (mask == 0).float().mean() < 1
    torch.testing.assert_close(y, ref[2](mask * ref[1](ref[0](x))), atol=ATOL, rtol=0)
    mlp.eval()
    torch.testing.assert_close(mlp(x), ref(x), atol=ATOL, rtol=0)


def test_batch_chunks_input_is_all_gathered():
    ref = nn.Linear(5, 7)
    layer = ColumnParallelLinear.from_linear(ref, cpus(3))
    x = torch.randn(5, 5)
    chunks = list(x.split([2, 2, 1]))
    torch.testing.assert_close(layer(chunks), ref(x), atol=ATOL, rtol=0)


def test_traffic_counts_both_directions():
    ref = nn.Linear(8, 6)  # sizes [2, 2, 2] over 3; shard 0 is home
    col = ColumnParallelLinear.from_linear(ref, cpus(3))
    x = torch.randn(4, 8, requires_grad=True)
    with TrafficMeter() as meter:
        col(x).sum().backward()
    f = 4  # float32 bytes
    sent = 2 * 4 * 8 * f + 2 * 4 * 2 * f  # input to shards 1, 2 + their outputs back home
    assert meter.by_kind["activations"] == sent
    assert meter.by_kind["activation_grads"] == sent


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="nn.Linear"):
        ColumnParallelLinear.from_linear(nn.Conv2d(1, 1, 1), cpus(2))
    with pytest.raises(ValueError, match="bad device"):
        ColumnParallelLinear.from_linear(nn.Linear(2, 2), ["cpu", "nope"])
    row = RowParallelLinear.from_linear(nn.Linear(6, 2), cpus(2))
    with pytest.raises(ValueError, match=r"\[3, 3\]"):
        row([torch.randn(1, 2), torch.randn(1, 4)])
    col = ColumnParallelLinear.from_linear(nn.Linear(6, 2), cpus(2))
    with pytest.raises(ValueError, match="shape"):
        col.load_linear(torch.zeros(3, 6), torch.zeros(3))


@pytest.mark.cuda
@pytest.mark.parametrize("devices", [["cuda:0", "cpu", "cuda:0"], ["cpu", "cuda:0"]])
def test_mixed_devices_column_row(devices):
    ref = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 4))
    col = ColumnParallelLinear.from_linear(ref[0], devices, gather_output=False,
                                           output_device="cpu")
    row = RowParallelLinear.from_linear(ref[2], devices, output_device="cpu")
    assert [s.weight.device.type for s in col.shards] == [torch.device(d).type for d in devices]
    mlp = nn.Sequential(col, Shardwise(nn.ReLU()), row)
    x = torch.randn(5, 6, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y, y_ref = mlp(x), ref(x_ref)
    assert y.device.type == "cpu"
    torch.testing.assert_close(y, y_ref, atol=1e-4, rtol=1e-4)
    y.sum().backward()
    y_ref.sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(col.to_linear().weight, ref[0].weight)
