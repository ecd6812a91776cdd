import copy
import pickle
import threading

import pytest
import torch
from torch import nn

from tandem.parallel import DataParallel, parallel_apply, replicate
from tandem.parallel.replicate import replicate_detached
from tandem.parallel.traffic import TrafficMeter


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.BatchNorm1d(4)])
        self.heads = nn.ModuleDict({"a": nn.Linear(4, 3), "b": nn.Linear(4, 3)})
        self.heads["b"].weight = self.heads["a"].weight  # tied
        self.scale = torch.tensor(2.0)  # a plain attribute tensor
        self.register_buffer("offset", torch.ones(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return (self.heads["a"](x) + self.heads["b"](x)) * self.scale + self.offset


def test_replica_zero_is_the_module_and_others_share_parameters():
    net = Net()
    replicas = replicate(net, ["cpu"] * 3)
    assert replicas[0] is net
    views = [dict(r.named_parameters(remove_duplicate=False)) for r in replicas[1:]]
    for r, mine in zip(replicas[1:], views):
        assert r is not net and r.blocks[0] is not net.blocks[0]
        # a view of the original's storage (no copy), its own tensor (its own gradient)
        for name, p in net.named_parameters():
            assert mine[name] is not p and mine[name].data_ptr() == p.data_ptr(), name
            assert mine[name].grad_fn is not None, name
        assert r.heads["b"].weight is r.heads["a"].weight  # still tied
        # own buffers: equal values, separate storage
        for a, b in zip(r.buffers(), net.buffers()):
            assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()


def test_gradients_of_all_replicas_sum_into_the_original():
    net = Net()
    reference = copy.deepcopy(net)
    xs = [torch.randn(3, 4), torch.randn(2, 4), torch.randn(4, 4)]
    replicas = replicate(net, ["cpu"] * 3)
    sum(r(x).square().sum() for r, x in zip(replicas, xs)).backward()
    for x in xs:  # one device, chunk by chunk: the same sum of gradients
        reference(x).square().sum().backward()
    for p, r in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, r.grad)


def test_replicas_are_reused_and_refreshed():
    net = Net()
    first = replicate(net, ["cpu"] * 2)
    old_buffer = first[1].blocks[1].running_mean
    again = replicate(net, ["cpu"] * 2)
    assert again[1] is first[1]  # same module objects, no rebuild
    assert again[1].blocks[1].running_mean is not old_buffer  # fresh buffer copies
    net.eval()
    assert replicate(net, ["cpu"] * 2)[1].blocks[1].training is False
    net.blocks[1].momentum = 0.5
    assert replicate(net, ["cpu"] * 2)[1].blocks[1].momentum == 0.5
    with torch.no_grad():
        net.blocks[1].running_mean.fill_(3.0)
    assert replicate(net, ["cpu"] * 2)[1].blocks[1].running_mean.eq(3.0).all()
    net.blocks[0] = nn.Linear(4, 4)  # replaced submodule: rebuilt
    rebuilt = replicate(net, ["cpu"] * 2)
    assert rebuilt[1] is not first[1]
    assert rebuilt[1].blocks[0].weight.data_ptr() == net.blocks[0].weight.data_ptr()


def test_other_threads_get_their_own_replicas():
    net = Net()
    mine = replicate(net, ["cpu"] * 2)
    theirs = []
    thread = threading.Thread(target=lambda: theirs.extend(replicate(net, ["cpu"] * 2)))
    thread.start()
    thread.join()
    assert theirs[1] is not mine[1] and theirs[0] is net


def test_hooks_run_in_replicas():
    net = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    seen = []
    net[0].register_forward_hook(lambda m, args, out: seen.append(out.shape[0]))
    net[0].register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    replicas = replicate(net, ["cpu"] * 2)
    xs = [torch.ones(2, 3), torch.ones(1, 3)]
    outs = parallel_apply(replicas, xs)
    assert sorted(seen) == [1, 2]
    torch.testing.assert_close(outs[0], net(xs[0]))


def test_copies_and_pickles_after_replication():
    net = Net()
    replicate(net, ["cpu"] * 2)
    clone = copy.deepcopy(net)
    restored = pickle.loads(pickle.dumps(net))
    x = torch.randn(3, 4)
    net.eval(), clone.eval(), restored.eval()
    torch.testing.assert_close(clone(x), net(x))
    torch.testing.assert_close(restored(x), net(x))
    assert replicate(clone, ["cpu"] * 2)[0] is clone


def test_single_device_returns_the_module():
    net = Net()
    assert replicate(net, ["cpu"]) == [net]


def test_bad_device_is_value_error():
    with pytest.raises(ValueError, match="'nowhere'"):
        replicate(Net(), ["cpu", "nowhere"])


def test_broadcast_traffic_is_counted_for_replicas_other_than_zero():
    net = nn.Linear(10, 10)  # 110 floats = 440 bytes
    with TrafficMeter() as meter:
        replicate(net, ["cpu"] * 3)
    assert meter.by_kind["broadcast"] == 2 * 440
    assert meter.by_dst[1] >= 440 and meter.by_dst[2] >= 440


# "cpu:0" is a torch.device unequal to "cpu" whose tensors live in the same memory: replicas
# there take the copy path that a GPU's take, so the CPU suite sees how many copies it makes
OTHER = ["cpu", "cpu", "cpu:0", "cpu:0"]


def _storages(replica: nn.Module) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in replica.parameters()}


@pytest.mark.parametrize("detached", [False, True], ids=["replicate", "replicate_detached"])
def test_replicas_on_one_other_device_share_one_copy(detached):
    """Two replicas on one device that is not the module's hold one copy of the weights between
    them (each its own tensor, for its own gradient), as on ``--devices cuda:0,0`` from a CPU
    module; replicas on the module's device hold its own storage."""
    net = Net()
    if detached:
        replicas, _ = replicate_detached(net, OTHER)
    else:
        replicas = replicate(net, OTHER)
    own, copied = _storages(replicas[1]), _storages(replicas[2])
    assert _storages(replicas[0]) == own == _storages(net)
    assert _storages(replicas[3]) == copied and not copied & own  # one copy, not the original
    # negative control: the counting sees per-replica copies where they are asked for
    apart = replicate(net, OTHER, share_params=False)
    assert _storages(apart[2]) != _storages(apart[3])



def test_the_last_steps_copies_are_let_go_before_the_new_ones_are_made(monkeypatch):
    """The cached replicas keep last step's copies of the weights on each other device; kept
    through the next copy, they would raise that device's peak by one more copy of the model.
    (``cpu:0`` takes a GPU's copy path: see OTHER.)"""
    import importlib
    import weakref

    replicate_module = importlib.import_module("tandem.parallel.replicate")  # not the function
    net = Net()
    old = [weakref.ref(p) for p in replicate(net, OTHER)[2].parameters()]
    assert all(ref() is not None for ref in old)  # held by the cache between steps
    seen = []
    real = replicate_module.copy_params

    def watching(*args, **kwargs):
        seen.append(sum(ref() is not None for ref in old))
        return real(*args, **kwargs)

    monkeypatch.setattr(replicate_module, "copy_params", watching)
    fresh = replicate(net, OTHER)
    assert seen == [0]
    assert _storages(fresh[2]) == _storages(fresh[3]) and not _storages(fresh[2]) & _storages(net)

@pytest.mark.parametrize("threads", [False, True])
def test_replicas_sharing_a_copy_get_every_gradient(threads):
    """The shared copy still sends each replica's gradient back: DataParallel over two replicas
    on the module's device and two on another equals one device (float64)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    reference = copy.deepcopy(net)
    x = torch.randn(7, 4, dtype=torch.float64)
    DataParallel(net, OTHER, backward_threads=threads)(x).square().sum().backward()
    reference(x).square().sum().backward()
    for p, r in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=0, atol=1e-12)


@pytest.mark.cuda
def test_cuda_replica_gradients_flow_back_to_cpu_module():
    net = Net()
    reference = copy.deepcopy(net)
    replicas = replicate(net, ["cpu", "cuda:0", "cuda:0"])
    assert replicas[1].blocks[0].weight.is_cuda
    # one copy per device: each replica its own view (its own gradient) of one storage
    a, b = replicas[1].blocks[0].weight, replicas[2].blocks[0].weight
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    xs = [torch.randn(3, 4), torch.randn(2, 4, device="cuda"), torch.randn(4, 4, device="cuda")]
    sum(r(x).square().sum().cpu() for r, x in zip(replicas, xs)).backward()
    for x in xs:
        reference(x.cpu()).square().sum().backward()
    for p, r in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-3, atol=1e-4)


@pytest.mark.cuda
def test_cuda_module_broadcast_between_cuda_replicas():
    net = Net().cuda()
    replicas = replicate(net, ["cuda:0", "cpu"])
    assert replicas[0] is net and not replicas[1].blocks[0].weight.is_cuda
    x = torch.randn(3, 4)
    (replicas[1](x).sum() + replicas[0](x.cuda()).sum().cpu()).backward()
    assert net.blocks[0].weight.grad.is_cuda


class _Comm:
    """``torch.cuda.comm``'s reduce, on CPU tensors: the inputs' devices are given, and, as
    torch does, a destination that holds none of the inputs is refused."""

    def __init__(self, devices):
        self.devices, self.destinations = devices, []

    def reduce_add_coalesced(self, inputs, destination):
        if destination not in [d.index for d in self.devices]:
            raise RuntimeError("reduce_add expects destination to be on the same GPU with one "
                               "of the tensors")
        self.destinations.append(destination)
        return [sum(column[1:], column[0].clone()) for column in zip(*inputs)]


@pytest.mark.parametrize("home_has_a_copy", [False, True])
def test_the_coalesced_gradient_reduce_lands_where_torch_allows(monkeypatch, home_has_a_copy):
    """DataParallel on 3 GPUs: the home replica is the module itself, so the replica gradients
    to add are on cuda:1 and cuda:2 only. Reducing them onto cuda:0 is refused by torch
    ("reduce_add expects destination ..."): they are added on cuda:1, then moved. (CPU
    tensors stand in for the devices' gradients; the fake refuses as torch does.)"""
    from types import SimpleNamespace

    from tandem.parallel import broadcast

    gpus = [torch.device(f"cuda:{i}") for i in range(3)]
    copies = gpus if home_has_a_copy else gpus[1:]
    comm = _Comm(copies)
    moved = []
    monkeypatch.setattr(broadcast, "comm", comm)
    monkeypatch.setattr(torch.Tensor, "to", lambda t, device: moved.append(device) or t)
    grads = [torch.full((2,), float(k + 1)) for k in range(len(copies))]  # 1 parameter
    ctx = SimpleNamespace(source=gpus[0], devices=copies)
    _, _, total = broadcast._Broadcast.backward(ctx, *grads)
    assert torch.equal(total, torch.full((2,), float(sum(range(1, len(copies) + 1)))))
    assert comm.destinations == [0 if home_has_a_copy else 1]
    assert moved == ([] if home_has_a_copy else [gpus[0]])


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 3, reason="needs 3 GPUs")
def test_dataparallel_on_three_gpus_gets_the_gradients_of_all_three():
    net = nn.Linear(4, 3).cuda()
    reference = copy.deepcopy(net)
    x = torch.randn(9, 4, device="cuda")
    DataParallel(net, device_ids=[0, 1, 2])(x).square().sum().backward()
    reference(x).square().sum().backward()
    torch.testing.assert_close(net.weight.grad, reference.weight.grad)
