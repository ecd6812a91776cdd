"""HybridParallel against the same model on one device: outputs, gradients, SGD steps, state."""

import copy

import pytest
import torch
from torch import nn

from tandem.hybrid import ColumnParallelLinear, HybridParallel, RowParallelLinear, plan
from tandem.parallel.traffic import TrafficMeter

TOL = dict(rtol=1e-4, atol=1e-5)
# check_against_reference runs in float64: the update must be the same to rounding (about
# 1e-16 here, whatever the thread count), far below any real difference. In float32 an
# ill-conditioned case (BatchNorm over 3 samples) rounds apart by 1e-5 relative, and by how
# much depends on the intra-op thread count: such a test measures rounding, not the update.
EXACT = dict(rtol=1e-9, atol=1e-12)


class Small(nn.Module):
    """features / avgpool / classifier like AlexNet, small enough for many cases."""

    def __init__(self, classes=7, bn=False):
        super().__init__()
        layers = [nn.Conv2d(3, 6, 3, padding=1)]
        layers += [nn.BatchNorm2d(6)] if bn else []
        self.features = nn.Sequential(*layers, nn.ReLU(inplace=True), nn.MaxPool2d(2))
        self.avgpool = nn.AdaptiveAvgPool2d(3)
        self.classifier = nn.Sequential(nn.Dropout(0.0), nn.Linear(54, 11), nn.ReLU(),
                                        nn.Dropout(0.0), nn.Linear(11, 10), nn.ReLU(),
                                        nn.Linear(10, classes))

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def merged_grads(hybrid: HybridParallel, model: nn.Module) -> dict:
    """Gradients keyed like ``model.named_parameters()``: shared modules' own, and the split
    layers' shard gradients put back together."""
    grads = {}
    for prefix, module in hybrid._parts:
        if isinstance(module, ColumnParallelLinear):
            grads[prefix + "weight"] = torch.cat([s.weight.grad for s in module.shards], 0)
            grads[prefix + "bias"] = torch.cat([s.bias.grad for s in module.shards], 0)
        elif isinstance(module, RowParallelLinear):
            grads[prefix + "weight"] = torch.cat([s.weight.grad for s in module.shards], 1)
            grads[prefix + "bias"] = module.bias.grad
        else:
            grads.update({prefix + k: p.grad for k, p in module.named_parameters()})
    return grads


def check_against_reference(model, devices, batch, size, steps=2):
    model = model.double()
    ref = copy.deepcopy(model)
    hybrid = HybridParallel(model, devices)
    opt = torch.optim.SGD(hybrid.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    for step in range(steps):
        x = torch.randn(batch, 3, size, size, dtype=torch.float64)
        out, ref_out = hybrid(x), ref(x)
        target = torch.randint(0, out.shape[1], (batch,))
        torch.testing.assert_close(out, ref_out, **EXACT)
        for o, opt_ in ((out, opt), (ref_out, ref_opt)):
            opt_.zero_grad()
            nn.functional.cross_entropy(o, target).backward()
        if step == 0:
            grads = merged_grads(hybrid, model)
            ref_grads = dict(ref.named_parameters())
            assert grads.keys() == ref_grads.keys()
            for name, g in grads.items():
                torch.testing.assert_close(g, ref_grads[name].grad, **EXACT, msg=name)
        opt.step()
        ref_opt.step()
    state, ref_state = hybrid.plain_state_dict(), ref.state_dict()
    assert list(state) == list(ref_state)
    for name, value in state.items():
        torch.testing.assert_close(value, ref_state[name], **EXACT, msg=name)
    return hybrid


@pytest.mark.parametrize("n,batch", [(1, 3), (2, 5), (3, 5), (3, 2), (4, 3)])
def test_small_model_matches_single_device(n, batch):
    check_against_reference(Small(), ["cpu"] * n, batch, 8)


class OddHead(Small):
    """A classifier that starts with BatchNorm1d (gathered first), in-place ReLUs, a Linear
    that cannot pair, and no avgpool."""

    def __init__(self, first_bn):
        super().__init__()
        del self.avgpool
        head = [nn.BatchNorm1d(96)] if first_bn else []
        self.classifier = nn.Sequential(*head, nn.Linear(96, 9), nn.BatchNorm1d(9),
                                        nn.ReLU(inplace=True), nn.Linear(9, 8),
                                        nn.ReLU(inplace=True), nn.Linear(8, 5))

    def forward(self, x):
        return self.classifier(torch.flatten(self.features(x), 1))


@pytest.mark.parametrize("first_bn", [True, False])
def test_other_classifier_shapes(first_bn):
    hybrid = check_against_reference(OddHead(first_bn), ["cpu"] * 3, 5, 8)
    kinds = [type(m).__name__ for m in hybrid.head]
    assert kinds[:2] == (["_Gather", "BatchNorm1d"] if first_bn else
                         ["ColumnParallelLinear", "BatchNorm1d"])
    assert "RowParallelLinear" in kinds


def test_batch_norm_in_features_buffers_follow_replica0():
    # one replica: the buffers must match exactly; more replicas follow DataParallel's policy
    check_against_reference(Small(bn=True), ["cpu"], 4, 8)


# uneven chunks everywhere, and a batch smaller than the device count; one SGD step each
# (the small model above covers momentum over two steps) to keep the CPU time low
ZOO = [("alexnet", 2, 3, 64), ("alexnet", 3, 2, 64), ("alexnet_grouped", 2, 3, 67),
       ("alexnet_grouped", 3, 4, 67), ("vgg11", 2, 3, 32), ("vgg11", 3, 2, 32)]


@pytest.mark.parametrize("arch,n,batch,size", ZOO)
def test_zoo_models_match_single_device(arch, n, batch, size):
    from tandem.models import create_model

    model = create_model(arch, num_classes=10, dropout=0.0, hidden_features=48)
    check_against_reference(model, ["cpu"] * n, batch, size, steps=1)


def test_parameters_once_and_no_stale_originals():
    model = Small()
    originals = {id(p) for p in model.classifier.parameters()}
    hybrid = HybridParallel(model, ["cpu"] * 3)
    params = list(hybrid.parameters())
    assert len({id(p) for p in params}) == len(params)
    assert not originals & {id(p) for p in params}
    assert sum(p.numel() for p in params) == sum(p.numel() for p in model.parameters())
    features = {id(p) for p in model.features.parameters()}
    assert features <= {id(p) for p in params}  # shared, trained in place
    assert not any(k.startswith("_skeleton") for k in hybrid.state_dict())


def test_plain_state_dict_round_trip_and_to_model():
    model = Small(bn=True)
    hybrid = HybridParallel(model, ["cpu"] * 3)
    state = hybrid.plain_state_dict()
    assert list(state) == list(model.state_dict())
    for k, v in model.state_dict().items():
        assert torch.equal(state[k], v), k

    other = Small(bn=True)
    with torch.no_grad():  # make its BN buffers differ too
        other.features[1].running_mean.uniform_()
    hybrid.load_plain_state_dict(other.state_dict())
    x = torch.randn(4, 3, 8, 8)
    hybrid.eval(), other.eval()
    torch.testing.assert_close(hybrid(x), other(x), **TOL)
    plain = hybrid.to_model()
    assert type(plain) is Small and not plain.training
    torch.testing.assert_close(plain(x), other(x), **TOL)
    for k, v in other.state_dict().items():
        assert torch.equal(plain.state_dict()[k], v), k


def test_load_plain_state_dict_errors_name_the_key():
    hybrid = HybridParallel(Small(), ["cpu"] * 2)
    state = Small().state_dict()
    del state["classifier.4.bias"]
    with pytest.raises(ValueError, match=r"classifier\.4\.bias"):
        hybrid.load_plain_state_dict(state)
    wrong = Small(classes=3).state_dict()
    with pytest.raises(ValueError, match=r"classifier\.6\.weight"):
        hybrid.load_plain_state_dict(wrong)


def test_checkpoint_saves_plain_model_and_loads_back(tmp_path):
    from tandem import checkpoint

    model = Small()
    hybrid = HybridParallel(model, ["cpu"] * 2)
    with torch.no_grad():
        hybrid.head[0].shards[1].weight.add_(1.0)  # make the split layers differ from `model`
    path = tmp_path / "ckpt.pt"
    checkpoint.save(path, hybrid)
    plain = Small()
    checkpoint.load(path, plain)
    x = torch.randn(3, 3, 8, 8)
    hybrid.eval()
    torch.testing.assert_close(plain.eval()(x), hybrid(x), **TOL)
    fresh = HybridParallel(Small(), ["cpu"] * 3)
    checkpoint.load(path, fresh)
    torch.testing.assert_close(fresh.eval()(x), hybrid(x), **TOL)


def test_train_eval_reach_every_part():
    hybrid = HybridParallel(Small(), ["cpu"] * 2)
    hybrid.eval()
    assert not any(m.training for m in hybrid.modules())
    hybrid.train()
    assert all(m.training for m in hybrid.modules())


def test_dropout_in_training_is_live_and_eval_is_exact():
    model = Small()
    for m in model.classifier:
        if isinstance(m, nn.Dropout):
            m.p = 0.5
    ref = copy.deepcopy(model).eval()
    hybrid = HybridParallel(model, ["cpu"] * 2)
    x = torch.randn(4, 3, 8, 8)
    hybrid.train()
    assert not torch.allclose(hybrid(x), ref(x))
    hybrid.eval()
    torch.testing.assert_close(hybrid(x), ref(x), **TOL)


@pytest.mark.parametrize("n,batch", [(2, 5), (3, 2)])
def test_measured_traffic_matches_plan(n, batch):
    model = Small()
    expected = plan(model, n, batch_size=batch, input_size=(3, 8, 8))
    hybrid = HybridParallel(model, ["cpu"] * n)
    with TrafficMeter() as meter:
        hybrid(torch.randn(batch, 3, 8, 8)).sum().backward()
    kinds = meter.by_kind
    assert kinds["activations"] + kinds["activation_grads"] == expected.hybrid_bytes["activations"]
    assert kinds["activations"] == kinds["activation_grads"]
    assert kinds["broadcast"] == expected.hybrid_bytes["parameters"]  # no buffers in Small
    assert kinds["reduce"] == expected.hybrid_bytes["gradients"]
    assert kinds["scatter"] == expected.hybrid_bytes["inputs"]


def test_bad_models_are_clear_errors():
    with pytest.raises(ValueError, match=r"looked for .classifier or .fc on Sequential and found "
                                         r"no such attribute \(its children: 0\)"):
        HybridParallel(nn.Sequential(nn.Linear(2, 2)), ["cpu"])

    class NotSequential(Small):
        def __init__(self):
            super().__init__()
            self.classifier = nn.ModuleList([nn.Linear(54, 7)])

    with pytest.raises(ValueError, match="nn.Sequential"):
        HybridParallel(NotSequential(), ["cpu"])

    class Extra(Small):  # does more after its classifier: refused at the first forward
        def __init__(self):
            super().__init__()
            self.head2 = nn.Linear(7, 7)

        def forward(self, x):
            return self.head2(super().forward(x))

    with pytest.raises(ValueError, match=r"Extra.forward does more after .classifier"):
        HybridParallel(Extra(), ["cpu", "cpu"])(torch.randn(2, 3, 6, 6))


@pytest.mark.cuda
@pytest.mark.parametrize("arch,devices", [("alexnet", ["cuda:0", "cuda:0"]),
                                          ("vgg11", ["cuda:0", "cuda:0", "cuda:0"])])
def test_zoo_models_on_cuda(arch, devices):
    from tandem.models import create_model

    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = create_model(arch, num_classes=10, dropout=0.0, hidden_features=48).cuda()
    ref = copy.deepcopy(model)
    hybrid = HybridParallel(model, devices)
    x = torch.randn(5, 3, 64, 64, device="cuda")
    torch.testing.assert_close(hybrid(x), ref(x), rtol=1e-3, atol=1e-4)
    hybrid(x).sum().backward()
    ref(x).sum().backward()
    torch.testing.assert_close(model.features[0].weight.grad, ref.features[0].weight.grad,
                               rtol=1e-3, atol=1e-4)


class BNNet(Small):
    """BatchNorm2d in ``features`` and BatchNorm1d inside the classifier (train mode)."""

    def __init__(self):
        super().__init__(bn=True)
        self.classifier = nn.Sequential(nn.Linear(54, 12), nn.BatchNorm1d(12), nn.ReLU(),
                                        nn.Linear(12, 10), nn.ReLU(), nn.Dropout(0.0),
                                        nn.Linear(10, 7))


@pytest.mark.parametrize("n,batch", [(2, 5), (3, 7), (4, 3)])
def test_sync_bn_in_features_and_bn1d_head_match_single_device(n, batch):
    """With SyncBatchNorm the trunk's batch statistics are the whole batch's, so a model with
    BN in features and BatchNorm1d in the classifier trains exactly like one device: outputs,
    gradients, running stats and weights over three momentum steps (uneven chunks, and a
    batch smaller than the device count)."""
    from tandem.parallel import convert_sync_batchnorm

    torch.manual_seed(0)
    hybrid = check_against_reference(convert_sync_batchnorm(BNNet()), ["cpu"] * n, batch, 8,
                                     steps=3)
    assert int(hybrid.plain_state_dict()["features.1.num_batches_tracked"]) == 3
    torch.manual_seed(0)  # negative control: each replica's own statistics are another update
    with pytest.raises(AssertionError):
        check_against_reference(BNNet(), ["cpu"] * n, batch, 8, steps=3)


def test_sync_bn_vgg11_bn_matches_single_device():
    from tandem.models import create_model
    from tandem.parallel import convert_sync_batchnorm

    torch.manual_seed(0)
    model = create_model("vgg11_bn", num_classes=10, dropout=0.0, hidden_features=48)
    check_against_reference(convert_sync_batchnorm(model), ["cpu"] * 2, 3, 32, steps=2)
