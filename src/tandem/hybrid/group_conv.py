"""A grouped ``Conv2d`` with its groups placed on different devices (AlexNet's two towers, 2012).

Groups are dealt round-robin over ``device_ids`` (group ``k`` on shard ``k % n``, only
``min(groups, n)`` shards used); a shard's groups stay one grouped conv, one kernel launch.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.errors import UsageError

from ..parallel.devices import as_device, index_of, resolve_devices
from ..parallel.parallel_apply import parallel_apply
from ._shards import move

class GroupParallelConv2d(nn.Module):
    """``nn.Conv2d(groups=g)`` split by groups over devices. Build with :meth:`from_conv`.

    Each shard's weight and bias are its own ``Parameter``s on its device; the conv they came
    from is copied, not modified. Forward, backward and optimizer steps match the original
    conv (up to float rounding); :meth:`to_conv` merges a copy back into one ``nn.Conv2d``.
    """

    def __init__(self, conv: nn.Conv2d, device_ids=None, output_device=None):
        super().__init__()
        if not isinstance(conv, nn.Conv2d):
            raise UsageError(f"GroupParallelConv2d needs an nn.Conv2d, got {type(conv).__name__}")
        devices = resolve_devices(device_ids)
        self.groups = conv.groups
        self.in_channels, self.out_channels = conv.in_channels, conv.out_channels
        self.cin_g, self.cout_g = conv.in_channels // conv.groups, conv.out_channels // conv.groups
        n = min(self.groups, len(devices))
        self.devices = devices[:n]
        #: groups_of[j]: the groups on shard j, in group order (j, j+n, j+2n, ...).
        self.groups_of = [list(range(j, self.groups, n)) for j in range(n)]
        self.output_device = as_device(output_device) if output_device is not None else devices[0]
        self.home = index_of(self.output_device, self.devices)
        self.shards = nn.ModuleList(
            nn.Conv2d(len(gs) * self.cin_g, len(gs) * self.cout_g, conv.kernel_size, conv.stride,
                      conv.padding, conv.dilation, groups=len(gs), bias=conv.bias is not None,
                      padding_mode=conv.padding_mode, device=device, dtype=conv.weight.dtype)
            for gs, device in zip(self.groups_of, self.devices)
        )
        self.load_conv(conv.weight, conv.bias)

    @classmethod
    def from_conv(cls, conv: nn.Conv2d, device_ids=None, output_device=None):
        """Split ``conv``'s groups round-robin over ``device_ids`` (see the module doc)."""
        return cls(conv, device_ids, output_device)

    def _rows(self, group: int) -> slice:
        return slice(group * self.cout_g, (group + 1) * self.cout_g)

    @torch.no_grad()
    def load_conv(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Copy a full conv weight ``(O, C/g, kh, kw)`` and bias ``(O,)`` into the shards."""
        expected = (self.out_channels, self.cin_g) + tuple(self.shards[0].kernel_size)
        if tuple(weight.shape) != expected:
            raise UsageError(f"conv weight has shape {tuple(weight.shape)}, expected {expected}")
        for shard, gs in zip(self.shards, self.groups_of):
            shard.weight.copy_(torch.cat([weight[self._rows(k)] for k in gs]))
            if shard.bias is not None:
                if bias is None:
                    raise UsageError("this conv has a bias but none was given")
                shard.bias.copy_(torch.cat([bias[self._rows(k)] for k in gs]))

    def _in_group_order(self, per_shard: list[torch.Tensor], dim: int) -> torch.Tensor:
        """Cut each shard's tensor into its groups' blocks and concatenate them in group order."""
        blocks: list = [None] * self.groups
        for t, gs in zip(per_shard, self.groups_of):
            for k, block in zip(gs, torch.split(t, self.cout_g, dim)):
                blocks[k] = block
        return torch.cat(blocks, dim)

    def merged_weight_bias(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Detached full weight and bias on the output device, in group order."""
        weight = self._in_group_order(
            [s.weight.detach().to(self.output_device) for s in self.shards], 0)
        if self.shards[0].bias is None:
            return weight, None
        return weight, self._in_group_order(
            [s.bias.detach().to(self.output_device) for s in self.shards], 0)

    def to_conv(self) -> nn.Conv2d:
        """A new ``nn.Conv2d(groups=g)`` on the output device holding a copy of the weights."""
        s = self.shards[0]
        weight, bias = self.merged_weight_bias()
        conv = nn.Conv2d(self.in_channels, self.out_channels, s.kernel_size, s.stride, s.padding,
                         s.dilation, groups=self.groups, bias=bias is not None,
                         padding_mode=s.padding_mode, device=self.output_device,
                         dtype=weight.dtype)
        conv.load_state_dict({"weight": weight} if bias is None else
                             {"weight": weight, "bias": bias})
        return conv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (N, C, H, W) or (C, H, W); channels are dim -3
        if x.dim() not in (3, 4) or x.shape[-3] != self.in_channels:
            raise UsageError(f"GroupParallelConv2d expected (N, {self.in_channels}, H, W) input, "
                             f"got {tuple(x.shape)}")
        inputs = []
        for j, (gs, device) in enumerate(zip(self.groups_of, self.devices)):
            # shard j's channels: its groups' blocks, in group order -> (N, len(gs)*C/g, H, W)
            parts = [x.narrow(-3, k * self.cin_g, self.cin_g) for k in gs]
            xj = parts[0] if len(parts) == 1 else torch.cat(parts, -3)
            inputs.append(move(xj, device, self.home, j))
        ys = parallel_apply(list(self.shards), [(x,) for x in inputs], devices=self.devices)
        # ys[j]: (N, len(gs)*O/g, H', W')
        ys = [move(y, self.output_device, j, self.home) for j, y in enumerate(ys)]
        return self._in_group_order(ys, -3)  # (N, O, H', W') on the output device

    def extra_repr(self) -> str:
        placement = ", ".join(f"{d}: groups {gs}" for d, gs in zip(self.devices, self.groups_of))
        return (f"{self.in_channels}, {self.out_channels}, groups={self.groups}, "
                f"output_device={self.output_device}, placement=[{placement}]")
