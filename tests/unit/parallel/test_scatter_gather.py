import collections
import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.parallel import gather, scatter, scatter_kwargs
from tandem.parallel.shares import shares
from tandem.parallel.traffic import TrafficMeter

Pair = collections.namedtuple("Pair", "left right")


@dataclasses.dataclass
class Box:
    tensor: object
    label: object = "box"


@dataclasses.dataclass(frozen=True)
class FrozenBox:
    tensor: object


def _leaf(batch):
    tensor_shapes = st.lists(st.integers(1, 3), max_size=2).map(lambda rest: (batch, *rest))
    tensors = tensor_shapes.map(lambda shape: torch.randn(shape))
    others = st.sampled_from([None, 0, 7, "text", 2.5, ("const",)])
    return st.one_of(tensors, others)


def _tree(batch):
    def extend(children):
        return st.one_of(
            st.lists(children, max_size=3),
            st.lists(children, max_size=3).map(tuple),
            st.dictionaries(st.sampled_from("abcd"), children, max_size=3),
            st.tuples(children, children).map(lambda t: Pair(*t)),
            children.map(Box),
            children.map(FrozenBox),
            children.map(lambda c: collections.OrderedDict(z=c, y=1)),
        )

    return st.recursive(_leaf(batch), extend, max_leaves=8)


def _assert_same(a, b):
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            _assert_same(getattr(a, f.name), getattr(b, f.name))
    else:
        assert a == b


def _tensors(obj, out):
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _tensors(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _tensors(v, out)
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            _tensors(getattr(obj, f.name), out)
    return out


@settings(max_examples=60, deadline=None)
@given(data=st.data(), batch=st.integers(1, 9), num_devices=st.integers(1, 5))
def test_gather_scatter_round_trip(data, batch, num_devices):
    tree = data.draw(_tree(batch))
    parts = scatter(tree, ["cpu"] * num_devices)
    has_tensor = bool(_tensors(tree, []))
    expected = min(batch, num_devices) if has_tensor else num_devices
    assert len(parts) == expected
    for part in parts:  # never an empty chunk, sizes differ by at most one
        sizes = {t.shape[0] for t in _tensors(part, [])}
        assert all(size >= 1 for size in sizes)
    _assert_same(gather(parts, "cpu"), tree)


@pytest.mark.parametrize("batch,devices,sizes", [
    (10, 4, [3, 3, 2, 2]), (2, 4, [1, 1]), (5, 1, [5]), (4, 4, [1, 1, 1, 1]), (0, 3, [0]),
])
def test_chunk_sizes_are_balanced_and_never_empty(batch, devices, sizes):
    parts = scatter(torch.arange(batch), ["cpu"] * devices)
    assert [len(p) for p in parts] == sizes


def _old_chunk_sizes(batch: int, num_devices: int) -> list[int]:
    """scatter_gather.chunk_sizes as it was before shares() became the one divider."""
    if batch <= 0:
        return [0]
    n = min(batch, num_devices)
    base, extra = divmod(batch, n)
    return [base + 1] * extra + [base] * (n - extra)


def _old_shard_sizes(batch: int, world_size: int) -> list[int]:
    """data.loader.shard_sizes as it was."""
    base, extra = divmod(batch, world_size)
    return [base + (1 if r < extra else 0) for r in range(world_size)]


def test_equal_shares_are_the_old_balanced_cuts_bit_for_bit():
    """shares(b, [1] * n) replaced both balanced dividers: the same lists for every batch, uneven
    ones and batches smaller than the device count included."""
    for batch in range(0, 300):
        for n in range(1, 17):
            assert shares(batch, [1] * n) == _old_shard_sizes(batch, n), (batch, n)
            used = max(1, min(batch, n))  # what scatter keeps: no empty chunk
            assert shares(batch, [1] * used) == _old_chunk_sizes(batch, n), (batch, n)
    assert shares(7, [1] * 3) != shares(7, [1, 2, 1])  # control: the weights matter


def test_small_batch_uses_fewer_replicas():
    parts = scatter((torch.randn(2, 3),), ["cpu"] * 4)
    assert len(parts) == 2 and [p[0].shape[0] for p in parts] == [1, 1]


def test_scatter_kwargs_equal_lengths_and_broadcasts_non_tensors():
    args, kwargs = scatter_kwargs((torch.randn(5, 2), "mode"), {"mask": torch.ones(5), "k": None},
                                  ["cpu"] * 3)
    assert len(args) == len(kwargs) == 3
    assert [a[0].shape[0] for a in args] == [2, 2, 1]
    assert all(a[1] == "mode" and kw["k"] is None for a, kw in zip(args, kwargs))
    assert [kw["mask"].shape[0] for kw in kwargs] == [2, 2, 1]
    args, kwargs = scatter_kwargs((), None, ["cpu"] * 2)
    assert len(args) == len(kwargs)


def test_split_along_other_dim_and_gather_back():
    x = torch.randn(2, 7, 3)
    parts = scatter(x, ["cpu"] * 3, dim=1)
    assert [p.shape[1] for p in parts] == [3, 2, 2]
    assert torch.equal(gather(parts, "cpu", dim=1), x)


def test_gradients_flow_through_scatter_and_gather():
    x = torch.randn(7, 3, requires_grad=True)
    weight = torch.randn(7, 3)
    parts = scatter(x, ["cpu"] * 3)
    out = gather([p * 2 for p in parts], "cpu")
    (out * weight).sum().backward()
    torch.testing.assert_close(x.grad, 2 * weight)


def test_scalars_gather_into_a_vector():
    out = gather([torch.tensor(1.0), torch.tensor(2.0), torch.tensor(3.0)], "cpu")
    assert out.shape == (3,) and out.tolist() == [1.0, 2.0, 3.0]


def test_zero_dim_inputs_reach_every_replica():
    parts = scatter((torch.randn(4, 2), torch.tensor(0.5)), ["cpu"] * 2)
    assert [p[1].item() for p in parts] == [0.5, 0.5]


def test_differing_non_tensors_gather_as_list():
    assert gather([{"n": 1}, {"n": 2}], "cpu") == {"n": [1, 2]}
    assert gather([(None,), (None,)], "cpu") == (None,)


def test_forced_chunk_sizes_and_mismatch_error():
    parts = scatter(torch.arange(6), ["cpu"] * 3, chunk_sizes=[1, 5])
    assert [p.tolist() for p in parts] == [[0], [1, 2, 3, 4, 5]]
    with pytest.raises(ValueError, match="7 entries"):
        scatter(torch.arange(7), ["cpu"] * 3, chunk_sizes=[1, 5])


def test_mismatched_replica_outputs_are_errors():
    with pytest.raises(ValueError, match="replica 1"):
        gather([{"a": torch.ones(1)}, {"b": torch.ones(1)}], "cpu")
    with pytest.raises(ValueError, match="replica 1"):
        gather([(torch.ones(1),), (torch.ones(1), torch.ones(1))], "cpu")


def test_traffic_is_counted_logically_on_one_device():
    x = torch.zeros(6, 4)  # 16 bytes a row
    with TrafficMeter() as meter:
        parts = scatter(x, ["cpu"] * 3)
        gather(parts, "cpu")
    # replica 0 lives where x lives: its chunk is free; replicas 1 and 2 each move 2 rows
    assert meter.by_kind["scatter"] == 2 * 2 * 16
    assert meter.by_kind["gather"] == 2 * 2 * 16
    assert meter.by_dst[1] == 32 and meter.by_dst[2] == 32 and meter.by_dst[0] == 64


@pytest.mark.cuda
def test_cuda_scatter_gather_gradients():
    x = torch.randn(5, 3, requires_grad=True)
    parts = scatter(x, ["cuda:0", "cuda:0"])
    assert all(p.is_cuda for p in parts)
    out = gather([p * 3 for p in parts], "cpu")
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 3.0))
    y = torch.randn(4, 2, device="cuda", requires_grad=True)
    back = gather(scatter(y, ["cuda:0", "cpu"]), "cuda:0")
    back.pow(2).sum().backward()
    torch.testing.assert_close(y.grad, 2 * y.detach())
