"""A small ResNet builder in the spirit of caffe2's ``ResNetBuilder``: it keeps the channel
count and appends modules named as torchvision's, so state dicts line up key for key.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn
from tandem.errors import UsageError
from tandem.keyed import DropPath, drop_path_rates


def on_meta(model: nn.Module) -> bool:
    """Whether ``model`` was built on the meta device (shapes only): it then skips its weight
    initialisation, as ``normal_`` on a meta tensor imports ``torch._dynamo`` (about 2 s)."""
    return any(p.is_meta for p in model.parameters())


def _conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


def _conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 1, stride=stride, bias=False)


class ZeroPadShortcut(nn.Module):
    """He et al.'s option-A shortcut, no parameters: every ``stride``-th pixel (a padded 3x3
    conv's output size), then zero channels appended."""

    def __init__(self, stride: int, extra_channels: int):
        super().__init__()
        self.stride = stride
        self.extra_channels = extra_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x[:, :, :: self.stride, :: self.stride]  # N, C, ceil(H/s), ceil(W/s)
        return F.pad(x, [0, 0, 0, 0, 0, self.extra_channels])  # N, C + extra, ...

    def extra_repr(self) -> str:
        return f"stride={self.stride}, extra_channels={self.extra_channels}"


class BasicBlock(nn.Module):
    """Two 3x3 convs (stride on the first) plus a shortcut; ``out = relu(F(x) + shortcut(x))``,
    ``F(x)`` through ``drop_path`` when the builder gives the block one."""

    last_bn = "bn2"  # the BN zeroed by zero_init_residual

    def __init__(self, cin: int, cout: int, stride: int, downsample: nn.Module):
        super().__init__()
        self.conv1 = _conv3x3(cin, cout, stride)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv3x3(cout, cout)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = downsample
        self.drop_path: DropPath | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.drop_path is not None:
            out = self.drop_path(out)  # each sample's branch kept or dropped whole
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride, as in torchvision's "ResNet v1.5"), 1x1 expand."""

    last_bn = "bn3"

    def __init__(self, cin: int, width: int, cout: int, stride: int, downsample: nn.Module):
        super().__init__()
        self.conv1 = _conv1x1(cin, width)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = _conv3x3(width, width, stride)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = _conv1x1(width, cout)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.drop_path: DropPath | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.drop_path is not None:
            out = self.drop_path(out)
        return self.relu(out + identity)


class ResNet(nn.Sequential):
    """A ResNet as a flat sequence (stem, ``layer1..N``, pool, ``fc``): no control flow in
    ``forward``, so it scripts and compiles as is."""


def init_resnet(model: nn.Module, zero_init_residual: bool = False) -> nn.Module:
    """Kaiming-normal (fan_out) convs, BN 1 and 0, Linear torch's default; ``zero_init_residual``
    starts each block as the identity (Goyal et al. 2017). A meta model is left untouched."""
    if on_meta(model):
        return model
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
    if zero_init_residual:
        for m in model.modules():
            if isinstance(m, (BasicBlock, Bottleneck)):
                nn.init.zeros_(getattr(m, m.last_bn).weight)
    return model


class ResNetBuilder:
    """Append a stem, stages of residual blocks and a head; then :meth:`build`. ``shortcut``
    (``"projection"``: 1x1 conv + BN, or ``"zero_pad"``) is where a block changes shape."""

    def __init__(self, in_channels: int = 3, *, shortcut: str = "projection",
                 zero_init_residual: bool = False, drop_path: float = 0.0):
        if shortcut not in ("projection", "zero_pad"):
            raise UsageError(f"shortcut must be 'projection' or 'zero_pad', got {shortcut!r}")
        if not 0.0 <= drop_path < 1.0:
            raise UsageError(f"drop_path must be in [0, 1), got {drop_path!r}")
        self.drop_path = float(drop_path)
        self.channels = in_channels
        self.shortcut = shortcut
        self.zero_init_residual = zero_init_residual
        self._layers: OrderedDict[str, nn.Module] = OrderedDict()
        self._stage: list[nn.Module] | None = None
        self._num_stages = 0

    def add_stem(self, width: int, kernel_size: int = 7, stride: int = 2,
                 max_pool: bool = True) -> "ResNetBuilder":
        """conv (no bias) + BN + ReLU, then an optional 3x3 stride-2 max-pool."""
        self._layers["conv1"] = nn.Conv2d(self.channels, width, kernel_size, stride=stride,
                                           padding=kernel_size // 2, bias=False)
        self._layers["bn1"] = nn.BatchNorm2d(width)
        self._layers["relu"] = nn.ReLU(inplace=True)
        if max_pool:
            self._layers["maxpool"] = nn.MaxPool2d(3, stride=2, padding=1)
        self.channels = width
        return self

    def start_stage(self) -> "ResNetBuilder":
        """Open stage ``layer{k}``; the blocks added next go into it."""
        self._close_stage()
        self._stage = []
        return self

    def add_basic_block(self, width: int, stride: int = 1) -> "ResNetBuilder":
        """Two 3x3 convs with ``width`` output channels."""
        block = BasicBlock(self.channels, width, stride, self._make_shortcut(width, stride))
        return self._append(block, width)

    def add_bottleneck(self, width: int, stride: int = 1, expansion: int = 4) -> "ResNetBuilder":
        """1x1 to ``width``, 3x3 with ``stride``, 1x1 to ``width * expansion`` channels."""
        cout = width * expansion
        block = Bottleneck(self.channels, width, cout, stride, self._make_shortcut(cout, stride))
        return self._append(block, cout)

    def add_stages(self, block: str, depths, widths) -> "ResNetBuilder":
        """One stage per ``(depth, width)`` of ``block`` (``"basic"``, ``"bottleneck"``), the
        first block of every stage but the first with stride 2."""
        add = self.add_basic_block if block == "basic" else self.add_bottleneck
        for stage, (depth, width) in enumerate(zip(depths, widths)):
            self.start_stage()
            for i in range(depth):
                add(width, stride=2 if stage > 0 and i == 0 else 1)
        return self

    def add_head(self, num_classes: int) -> "ResNetBuilder":
        """Global average pool (any input size) + flatten + Linear classifier ``fc``."""
        self._close_stage()
        self._layers["avgpool"] = nn.AdaptiveAvgPool2d(1)
        self._layers["flatten"] = nn.Flatten(1)
        self._layers["fc"] = nn.Linear(self.channels, num_classes)
        return self

    def build(self) -> ResNet:
        """The initialised model; block ``k`` of ``n`` drops its branch with ``drop_path * k /
        (n - 1)`` (:func:`~tandem.keyed.drop_path_rates`)."""
        if "fc" not in self._layers:
            raise UsageError("ResNetBuilder.build(): call add_head(num_classes) first")
        model = ResNet(self._layers)
        blocks = [m for m in model.modules() if isinstance(m, (BasicBlock, Bottleneck))]
        for block, rate in zip(blocks, drop_path_rates(self.drop_path, len(blocks))):
            if rate > 0:
                block.drop_path = DropPath(rate)
        return init_resnet(model, self.zero_init_residual)

    def _append(self, block: nn.Module, cout: int) -> "ResNetBuilder":
        if self._stage is None:
            raise UsageError("ResNetBuilder: call start_stage() before adding blocks")
        self._stage.append(block)
        self.channels = cout
        return self

    def _close_stage(self) -> None:
        if self._stage:
            self._num_stages += 1
            self._layers[f"layer{self._num_stages}"] = nn.Sequential(*self._stage)
        self._stage = None

    def _make_shortcut(self, cout: int, stride: int) -> nn.Module:
        cin = self.channels
        if stride == 1 and cin == cout:
            return nn.Identity()
        if self.shortcut == "projection":
            return nn.Sequential(_conv1x1(cin, cout, stride), nn.BatchNorm2d(cout))
        if cout < cin:
            raise UsageError(f"zero_pad shortcut cannot shrink channels ({cin} -> {cout})")
        return ZeroPadShortcut(stride, cout - cin)
