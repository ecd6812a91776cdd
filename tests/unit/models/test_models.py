"""The model zoo: registry, exact layouts and parameter counts, forward/backward on small inputs."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tandem.models import (
    ResNetBuilder,
    count_parameters,
    create_model,
    list_models,
    model_info,
    native_input_size,
    register_model,
)
from tandem.models.builder import BasicBlock, Bottleneck, ZeroPadShortcut

EXPECTED_NAMES = {
    "alexnet", "alexnet_grouped",
    "cifar_resnet20", "cifar_resnet32", "cifar_resnet44", "cifar_resnet56", "cifar_resnet110",
    "resnet18", "resnet34", "resnet50", "resnet101", "resnet152",
    "vgg11", "vgg11_bn", "vgg13", "vgg13_bn", "vgg16", "vgg16_bn", "vgg19", "vgg19_bn",
}

# torchvision's published counts (1000 classes) and He et al.'s CIFAR nets (10 classes);
# the CIFAR counts are 97,216 n - 21,926 for depth 6n+2 (see cifar_resnet.py).
PARAMS = {
    "alexnet": 61_100_840, "alexnet_grouped": 60_965_224,
    "resnet18": 11_689_512, "resnet34": 21_797_672, "resnet50": 25_557_032,
    "resnet101": 44_549_160, "resnet152": 60_192_808,
    "vgg11": 132_863_336, "vgg11_bn": 132_868_840, "vgg13": 133_047_848,
    "vgg13_bn": 133_053_736, "vgg16": 138_357_544, "vgg16_bn": 138_365_992,
    "vgg19": 143_667_240, "vgg19_bn": 143_678_248,
    "cifar_resnet20": 269_722, "cifar_resnet32": 464_154, "cifar_resnet44": 658_586,
    "cifar_resnet56": 853_018, "cifar_resnet110": 1_727_962,
}


def meta_model(name, **kw):
    with torch.device("meta"):
        return create_model(name, **kw)


# -- registry ------------------------------------------------------------------------------


def test_list_models_names_every_model():
    assert set(list_models()) == EXPECTED_NAMES
    assert list_models().index("cifar_resnet20") < list_models().index("cifar_resnet110")


def test_unknown_model_suggests_the_closest_names_else_lists_them_all():
    for typo, first in (("resnt50", "resnet50"), ("resnet_18", "resnet18"),
                        ("cifar_resnet21", "cifar_resnet20"), ("VGG16-bn", "vgg16_bn")):
        with pytest.raises(ValueError) as info:
            create_model(typo)
        message = str(info.value)
        assert message.startswith(f"unknown model {typo!r}: did you mean {first}")
        assert "`tandem models`" in message and "alexnet_grouped" not in message
    with pytest.raises(ValueError, match="unknown model 'zzz'; valid models: alexnet, .*vgg19_bn"):
        create_model("zzz")  # nothing close: every name


def test_unknown_option_names_it_and_the_accepted_ones():
    with pytest.raises(ValueError, match="'vgg11'.*dropuot.*accepts: num_classes, in_channels"):
        create_model("vgg11", dropuot=0.1)
    with pytest.raises(ValueError, match="zero_init_residual"):
        create_model("alexnet", zero_init_residual=True)


@pytest.mark.parametrize("kw", [{"num_classes": 0}, {"num_classes": True},
                                {"in_channels": 2.0}, {"in_channels": -1}])
def test_bad_sizes_are_value_errors(kw):
    with pytest.raises(ValueError, match="must be a positive int"):
        create_model("cifar_resnet20", **kw)


def test_bad_dropout_is_a_value_error():
    with pytest.raises(ValueError, match="dropout"):
        create_model("alexnet", dropout=1.5)


def test_registering_a_name_twice_is_refused():
    def alexnet(num_classes=1000, in_channels=3):
        raise AssertionError("must not be registered")

    with pytest.raises(ValueError, match="registered twice"):
        register_model(native_input_size=1, min_input_size=1, family="x")(alexnet)
    assert model_info("alexnet").fn is not alexnet


def test_num_classes_defaults_to_the_models_dataset():
    # None means the entry point's own default: CIFAR nets are 10-class, ImageNet 1000-class.
    assert meta_model("cifar_resnet20").fc.out_features == 10
    assert meta_model("resnet18").fc.out_features == 1000
    assert meta_model("cifar_resnet20", num_classes=100).fc.out_features == 100
    assert meta_model("alexnet", num_classes=10).classifier[-1].out_features == 10
    assert model_info("cifar_resnet56").default_num_classes == 10


def test_native_input_sizes():
    for name in list_models():
        expected = 32 if name.startswith("cifar") else 227 if name == "alexnet_grouped" else 224
        assert native_input_size(name) == expected, name


# -- exact layouts --------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_parameter_count_is_exact(name):
    # Built on the meta device: shapes only, so the 140M-parameter VGGs cost nothing.
    assert count_parameters(meta_model(name)) == PARAMS[name]


def test_cifar_param_formula():
    for depth in (20, 32, 44, 56, 110):
        n = (depth - 2) // 6
        assert PARAMS[f"cifar_resnet{depth}"] == 97_216 * n - 21_926


def test_resnet_state_dict_keys_follow_torchvision():
    keys = meta_model("resnet50").state_dict().keys()
    for key in ["conv1.weight", "bn1.running_var", "layer1.0.downsample.0.weight",
                "layer1.0.downsample.1.num_batches_tracked", "layer3.5.conv3.weight",
                "layer4.2.bn3.bias", "fc.weight", "fc.bias"]:
        assert key in keys
    assert not any(k.startswith("layer5") or k.startswith("layer3.6") for k in keys)


def test_bottleneck_strides_on_the_3x3_and_projects_only_on_shape_change():
    model = meta_model("resnet50")
    for stage in (2, 3, 4):
        block = getattr(model, f"layer{stage}")[0]
        assert block.conv1.stride == (1, 1) and block.conv2.stride == (2, 2)
        assert isinstance(block.downsample, nn.Sequential)
        assert block.downsample[0].stride == (2, 2)
    assert isinstance(model.layer1[0].downsample, nn.Sequential)  # 64 -> 256 channels
    assert isinstance(model.layer1[1].downsample, nn.Identity)
    blocks = [m for m in model.modules() if isinstance(m, Bottleneck)]
    assert len(blocks) == 16


def test_cifar_resnet_layout_and_option_a_shortcuts():
    model = meta_model("cifar_resnet20")
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(convs) + len(linears) == 20  # 6n+2 weighted layers, no projection convs
    assert [len(getattr(model, f"layer{i}")) for i in (1, 2, 3)] == [3, 3, 3]
    assert [getattr(model, f"layer{i}")[0].conv1.out_channels for i in (1, 2, 3)] == [16, 32, 64]
    shortcuts = [m for m in model.modules() if isinstance(m, ZeroPadShortcut)]
    assert len(shortcuts) == 2
    assert sum(p.numel() for s in shortcuts for p in s.parameters()) == 0


@pytest.mark.parametrize("size", [8, 7])
def test_zero_pad_shortcut_subsamples_and_pads(size):
    x = torch.randn(2, 16, size, size)
    y = ZeroPadShortcut(stride=2, extra_channels=16)(x)
    half = math.ceil(size / 2)
    assert y.shape == (2, 32, half, half)
    torch.testing.assert_close(y[:, :16], x[:, :, ::2, ::2])
    assert torch.all(y[:, 16:] == 0)


def test_alexnet_layouts():
    grouped = meta_model("alexnet_grouped")
    convs = [m for m in grouped.features if isinstance(m, nn.Conv2d)]
    assert [c.out_channels for c in convs] == [96, 256, 384, 384, 256]
    assert [c.groups for c in convs] == [1, 2, 1, 2, 2]
    assert sum(isinstance(m, nn.LocalResponseNorm) for m in grouped.features) == 2
    plain = meta_model("alexnet")
    assert [c.out_channels for c in plain.features if isinstance(c, nn.Conv2d)] == \
        [64, 192, 384, 256, 256]
    for model in (grouped, plain):
        assert isinstance(model.classifier, nn.Sequential)
        kinds = [type(m).__name__ for m in model.classifier]
        assert kinds == ["Dropout", "Linear", "ReLU", "Dropout", "Linear", "ReLU", "Linear"]
        assert model.avgpool.output_size == 6


def test_vgg_layout():
    model = meta_model("vgg16_bn")
    assert sum(isinstance(m, nn.Conv2d) for m in model.features) == 13
    assert sum(isinstance(m, nn.BatchNorm2d) for m in model.features) == 13
    assert sum(isinstance(m, nn.MaxPool2d) for m in model.features) == 5
    assert model.avgpool.output_size == 7
    assert [m.in_features for m in model.classifier if isinstance(m, nn.Linear)] == \
        [25088, 4096, 4096]


def test_alexnet_grouped_conv_equals_two_half_convs():
    """Krizhevsky's two towers: a groups=2 conv is two half-convs side by side."""
    model = create_model("alexnet_grouped", num_classes=10, hidden_features=32)
    grouped = [m for m in model.features if isinstance(m, nn.Conv2d) and m.groups == 2]
    assert len(grouped) == 3
    for conv in grouped:
        x = torch.randn(2, conv.in_channels, 9, 9)
        cin, cout = conv.in_channels // 2, conv.out_channels // 2
        halves = [
            F.conv2d(x[:, g * cin:(g + 1) * cin], conv.weight[g * cout:(g + 1) * cout],
                     conv.bias[g * cout:(g + 1) * cout], padding=conv.padding)
            for g in range(2)
        ]
        torch.testing.assert_close(conv(x), torch.cat(halves, dim=1))


# -- forward and backward -------------------------------------------------------------------


def _small_input_side(name):
    # ResNets take any size; AlexNets and VGGs run at the smallest size their pools allow.
    return max(model_info(name).min_input_size, 32)


@pytest.mark.parametrize("name", list_models())
def test_forward_backward_small_input(name):
    # The 4096-wide classifiers of AlexNet and VGG take seconds just to initialise on this
    # CPU, so they run with a narrow classifier here (their full-width layout is checked by the
    # exact counts above, and alexnet/vgg11 run full-width below). Conv stacks run as built.
    kw = {"hidden_features": 64} if model_info(name).family in ("vgg", "alexnet") else {}
    model = create_model(name, num_classes=7, **kw)
    side = _small_input_side(name)
    x = torch.randn(2, 3, side, side, requires_grad=True)
    out = model(x)
    assert out.shape == (2, 7)
    assert torch.isfinite(out).all()
    out.square().mean().backward()
    assert torch.isfinite(x.grad).all()
    for pname, p in model.named_parameters():
        assert p.grad is not None, pname
        assert torch.isfinite(p.grad).all(), pname


@pytest.mark.parametrize("name", ["alexnet", "vgg11"])
def test_full_width_classifier_runs(name):
    model = create_model(name, num_classes=5, dropout=0.0)
    side = model_info(name).min_input_size
    out = model(torch.randn(2, 3, side, side))
    out.sum().backward()
    assert out.shape == (2, 5)
    linears = [m for m in model.classifier if isinstance(m, nn.Linear)]
    assert [m.out_features for m in linears] == [4096, 4096, 5]
    assert all(torch.isfinite(m.weight.grad).all() for m in linears)


@pytest.mark.parametrize("name", list_models())
def test_min_input_size_and_in_channels(name):
    """Every model takes 1-channel input at its min size; one pixel smaller fails (meta)."""
    model = meta_model(name, num_classes=3, in_channels=1)
    info = model_info(name)
    s = info.min_input_size
    assert model(torch.empty(2, 1, s, s, device="meta")).shape == (2, 3)
    if s > 1:
        with pytest.raises(RuntimeError):
            model(torch.empty(2, 1, s - 1, s - 1, device="meta"))


def test_cifar_resnet20_on_8x8_digits():
    model = create_model("cifar_resnet20", in_channels=1)
    out = model(torch.randn(4, 1, 8, 8))
    assert out.shape == (4, 10) and torch.isfinite(out).all()


# -- initialisation ---------------------------------------------------------------------------


def test_resnet_init_kaiming_and_bn():
    model = create_model("cifar_resnet56")
    conv = model.layer3[4].conv2  # 64 -> 64, 3x3: fan_out = 576
    assert conv.weight.std().item() == pytest.approx(math.sqrt(2 / 576), rel=0.05)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            assert torch.all(m.weight == 1) and torch.all(m.bias == 0)


@pytest.mark.parametrize("name", ["cifar_resnet20", "resnet18", "resnet50"])
def test_zero_init_residual_makes_blocks_start_as_identity(name):
    model = create_model(name, zero_init_residual=True).eval()
    blocks = [m for m in model.modules() if isinstance(m, (BasicBlock, Bottleneck))]
    for block in blocks:
        last = getattr(block, block.last_bn)
        assert torch.all(last.weight == 0)
        assert torch.all(block.bn1.weight == 1)
    block = blocks[-1]
    x = torch.randn(2, block.conv1.in_channels, 4, 4)
    with torch.no_grad():
        torch.testing.assert_close(block(x), F.relu(block.downsample(x)))


# -- builder ----------------------------------------------------------------------------------


def test_builder_makes_a_custom_resnet():
    b = ResNetBuilder(in_channels=2, shortcut="zero_pad")
    b.add_stem(8, kernel_size=3, stride=1, max_pool=False)
    b.start_stage().add_basic_block(8).add_basic_block(8)
    b.start_stage().add_basic_block(16, stride=2)
    model = b.add_head(num_classes=4).build()
    assert [n for n, _ in model.named_children()] == \
        ["conv1", "bn1", "relu", "layer1", "layer2", "avgpool", "flatten", "fc"]
    assert model(torch.randn(3, 2, 5, 5)).shape == (3, 4)


def test_builder_misuse_is_a_clear_error():
    with pytest.raises(ValueError, match="start_stage"):
        ResNetBuilder().add_stem(8).add_basic_block(8)
    with pytest.raises(ValueError, match="add_head"):
        ResNetBuilder().add_stem(8).build()
    with pytest.raises(ValueError, match="shortcut"):
        ResNetBuilder(shortcut="option_c")


# -- scripting ----------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("name", ["cifar_resnet20", "alexnet_grouped"])
def test_torch_jit_script_matches_eager(name):
    kw = {"hidden_features": 32} if name.startswith("alexnet") else {}
    model = create_model(name, num_classes=5, **kw).eval()
    scripted = torch.jit.script(model)
    side = model_info(name).min_input_size if name.startswith("alexnet") else 16
    x = torch.randn(2, 3, side, side)
    with torch.no_grad():
        torch.testing.assert_close(scripted(x), model(x))


@pytest.mark.parametrize("name", ["resnet18", "vgg11_bn", "cifar_resnet20"])
def test_a_meta_build_skips_the_weight_init(name, monkeypatch):
    """On the meta device there are no values to set, and torch's normal_ there imports
    torch._dynamo (seconds per process): the init is skipped. A real build still runs it
    (the negative control)."""
    calls = []
    real = nn.init.kaiming_normal_
    monkeypatch.setattr(nn.init, "kaiming_normal_",
                        lambda t, **kw: calls.append(t) or real(t, **kw))
    with torch.device("meta"):
        model = create_model(name, num_classes=3)
    assert all(p.is_meta for p in model.parameters()) and calls == []
    create_model(name, num_classes=3)
    assert calls and not any(t.is_meta for t in calls)


# -- drop path ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["cifar_resnet20", "resnet50"])
def test_drop_path_is_linear_over_depth_and_leaves_the_model_alone(name):
    """``drop_path=P``: block k of n drops its branch with P k / (n - 1), as timm's ResNets
    (the first block gets no DropPath); the same weights, keys and parameter count; by
    default no DropPath at all (the model is the paper's)."""
    from tandem.keyed import DropPath

    torch.manual_seed(0)
    plain = create_model(name, num_classes=5)
    torch.manual_seed(0)
    dropped = create_model(name, num_classes=5, drop_path=0.2)
    assert not any(isinstance(m, DropPath) for m in plain.modules())
    blocks = [m for m in dropped.modules() if isinstance(m, (BasicBlock, Bottleneck))]
    rates = [0.0 if b.drop_path is None else b.drop_path.p for b in blocks]
    assert rates == pytest.approx([0.2 * k / (len(blocks) - 1) for k in range(len(blocks))])
    assert blocks[0].drop_path is None
    assert count_parameters(plain) == count_parameters(dropped)
    a, b = plain.state_dict(), dropped.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(dropped.eval()(x), plain.eval()(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="drop_path"):
        create_model(name, drop_path=1.0)
    with pytest.raises(ValueError, match="drop_path"):
        create_model("alexnet", drop_path=0.1)
