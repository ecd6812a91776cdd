"""The MAC counter (FlopCounterMode) against hand counts and torchvision's published numbers."""

import pytest
import torch
from torch import nn

from tandem.models import count_macs, count_parameters, create_model, mac_breakdown


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)  # 3x10x10 -> 8x10x10
        self.bn = nn.BatchNorm2d(8)
        self.grouped = nn.Conv2d(8, 4, 3, stride=2, groups=2)  # 8x10x10 -> 4x4x4
        self.pool = nn.MaxPool2d(1)
        self.fc = nn.Linear(64, 5)
        self.fc2 = nn.Linear(5, 5, bias=False)

    def forward(self, x):
        x = self.pool(self.grouped(torch.relu(self.bn(self.conv(x)))))
        x = self.fc(x.flatten(1))
        return self.fc2(self.fc2(x))  # fc2 runs twice, so it counts twice


def test_hand_count_small_net():
    # conv:    800 outputs x (3 in x 3 x 3)          = 21,600
    # grouped:  64 outputs x (8/2 in x 3 x 3)        =  2,304
    # fc:        5 outputs x 64 in                   =    320
    # fc2:  2 calls x 5 outputs x 5 in               =     50
    per_image = 21_600 + 2_304 + 320 + 50
    model = Small()
    assert count_macs(model, (1, 3, 10, 10)) == per_image
    assert count_macs(model, (2, 3, 10, 10)) == 2 * per_image
    assert mac_breakdown(model, (1, 3, 10, 10)) == {
        "conv": 21_600, "grouped": 2_304, "fc": 320, "fc2": 50}


def test_counting_leaves_the_model_as_it_was():
    model = Small().train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    count_macs(model, (2, 3, 10, 10))
    assert model.training
    # eval mode during the count, so BN running stats are untouched
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(not m._forward_hooks for m in model.modules())


def test_grouped_conv_costs_one_over_groups():
    dense, grouped = nn.Conv2d(8, 8, 3), nn.Conv2d(8, 8, 3, groups=4)
    assert count_macs(dense, (1, 8, 6, 6)) == 4 * count_macs(grouped, (1, 8, 6, 6))


def test_bad_input_size():
    with pytest.raises(ValueError, match="input_size"):
        count_macs(Small(), (1, 3, 0, 10))


def test_count_parameters_trainable_only():
    model = Small()
    model.fc.weight.requires_grad_(False)
    assert count_parameters(model) - count_parameters(model, trainable_only=True) == 320


# torchvision's published GFLOPS (which are Conv+Linear MACs) at 224x224, to 2 decimals.
PUBLISHED = {"alexnet": 0.71, "resnet18": 1.81, "resnet34": 3.66, "resnet50": 4.09,
             "resnet101": 7.80, "resnet152": 11.51, "vgg11": 7.61, "vgg11_bn": 7.61,
             "vgg13": 11.31, "vgg16": 15.47, "vgg19": 19.63, "vgg19_bn": 19.63}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_matches_torchvision_published_macs(name):
    with torch.device("meta"):  # shape-only forward: no memory, no arithmetic
        model = create_model(name)
    assert round(count_macs(model, (1, 3, 224, 224)) / 1e9, 2) == PUBLISHED[name]


def test_alexnet_grouped_hand_count_at_227():
    # Krizhevsky 2012 at 227x227 (see the layer table in alexnet.py).
    convs = (55 * 55 * 96 * 3 * 11 * 11 + 27 * 27 * 256 * 48 * 25 + 13 * 13 * 384 * 256 * 9
             + 13 * 13 * 384 * 192 * 9 + 13 * 13 * 256 * 192 * 9)
    fcs = 9216 * 4096 + 4096 * 4096 + 4096 * 1000
    with torch.device("meta"):
        model = create_model("alexnet_grouped")
    assert count_macs(model, (1, 3, 227, 227)) == convs + fcs
