"""Model-parallel Linear layers: split the output features (column) or the input features (row).

``Column(gather_output=False) -> Shardwise(ReLU, Dropout) -> Row`` moves activations once (both
split by :func:`~tandem.hybrid._shards.split_sizes`). Warning: the shards hold their *own*
Parameters; the original layer goes stale (``to_linear()`` merges a copy back).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from tandem.errors import UsageError
from tandem.keyed import stream as keyed_stream

from ..parallel.devices import as_device, index_of, resolve_devices
from ..parallel.parallel_apply import parallel_apply
from ._shards import move, split_sizes


class _ShardedLinear(nn.Module):
    """What the column and row layers share: devices, home slot, split sizes, shard list."""

    def __init__(self, in_features: int, out_features: int, device_ids, output_device, split: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        devices = resolve_devices(device_ids)
        self.sizes = split_sizes(split, len(devices))
        self.devices = devices[: len(self.sizes)]  # only as many shards as features
        self.output_device = as_device(output_device) if output_device is not None else devices[0]
        self.home = index_of(self.output_device, self.devices)
        self.shards = nn.ModuleList()

    @classmethod
    def _copy_of(cls, linear: nn.Linear, **options) -> "_ShardedLinear":
        """A layer of ``cls`` holding a copy of ``linear``'s values (``linear`` is not modified)."""
        if not isinstance(linear, nn.Linear):
            raise UsageError(f"{cls.__name__}.from_linear needs an nn.Linear, got "
                             f"{type(linear).__name__}")
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                    dtype=linear.weight.dtype, **options)
        layer.load_linear(linear.weight, linear.bias)
        return layer

    @torch.no_grad()
    def load_linear(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Copy a full ``(out, in)`` weight and ``(out,)`` bias into the shards' slices."""
        expected = (self.out_features, self.in_features)
        if tuple(weight.shape) != expected:
            raise UsageError(f"weight has shape {tuple(weight.shape)}, expected {expected}")
        held = self.plain_pieces()
        if "bias" in held and bias is None:
            raise UsageError("this layer has a bias but none was given")
        for key, value in (("weight", weight), ("bias", bias)):
            if key in held:
                params, dim = held[key]
                for p, v in zip(params, [value] if dim is None else value.split(self.sizes, dim)):
                    p.copy_(v)

    def merged_weight_bias(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Detached full weight and bias on the output device."""
        held = self.plain_pieces()

        def whole(key: str) -> torch.Tensor | None:
            if key not in held:
                return None
            params, dim = held[key]
            if dim is None:  # the row layer's bias, on the output device
                return params[0].detach()
            return torch.cat([p.detach().to(self.output_device) for p in params], dim)

        return whole("weight"), whole("bias")

    def _run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """``shards[j](inputs[j])``, each shard in its own thread (one inline)."""
        return list(parallel_apply(list(self.shards), [(x,) for x in inputs], devices=self.devices))

    def to_linear(self) -> nn.Linear:
        """A new ``nn.Linear`` on the output device holding a copy of the merged parameters."""
        weight, bias = self.merged_weight_bias()
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None,
                           device=weight.device, dtype=weight.dtype)
        linear.load_state_dict({"weight": weight} if bias is None else
                               {"weight": weight, "bias": bias})
        return linear

    def extra_repr(self) -> str:
        devs = ", ".join(str(d) for d in self.devices)
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"sizes={self.sizes}, devices=[{devs}], output_device={self.output_device}")


class ColumnParallelLinear(_ShardedLinear):
    """``nn.Linear`` with its output features split over ``device_ids`` (10 over 3 devices is
    4+3+3; with fewer outputs than devices only the first shards are used).

    ``forward(x)`` takes a tensor ``(..., in_features)`` on the output device, broadcast to
    every shard, or a list of batch chunks (chunk ``i`` on ``device_ids[i]``, as data-parallel
    replicas give them), which every shard concatenates. It returns ``(..., out_features)`` on
    the output device when ``gather_output``, else the shards' blocks ``(..., sizes[j])``.
    """

    def __init__(self, in_features: int, out_features: int, device_ids=None, bias: bool = True,
                 gather_output: bool = True, output_device=None, dtype=None):
        super().__init__(in_features, out_features, device_ids, output_device, out_features)
        self.gather_output = gather_output
        for size, device in zip(self.sizes, self.devices):
            self.shards.append(nn.Linear(in_features, size, bias=bias, device=device, dtype=dtype))

    @classmethod
    def from_linear(cls, linear: nn.Linear, device_ids=None, gather_output: bool = True,
                    output_device=None) -> "ColumnParallelLinear":
        """Split ``linear`` by output features; its values are copied, it is not modified."""
        return cls._copy_of(linear, device_ids=device_ids, gather_output=gather_output,
                            output_device=output_device)

    def plain_pieces(self) -> dict:
        """``{"weight"|"bias": (shard parameters, dim they are split along)}`` (:mod:`.plain`)."""
        pieces = {"weight": ([s.weight for s in self.shards], 0)}
        if self.shards[0].bias is not None:
            pieces["bias"] = ([s.bias for s in self.shards], 0)
        return pieces

    def _inputs(self, x) -> list[torch.Tensor]:
        if isinstance(x, torch.Tensor):  # on the output device: broadcast to every shard
            return [move(x, d, self.home, j) for j, d in enumerate(self.devices)]
        chunks = list(x)  # batch chunks, chunk i on replica i: every shard gathers all of them
        return [torch.cat([move(c, d, i, j) for i, c in enumerate(chunks)], 0)
                for j, d in enumerate(self.devices)]

    def forward(self, x):
        ys = self._run(self._inputs(x))  # (..., sizes[j]) on devices[j]
        if not self.gather_output:
            return ys
        return torch.cat([move(y, self.output_device, j, self.home) for j, y in enumerate(ys)], -1)


class RowParallelLinear(_ShardedLinear):
    """``nn.Linear`` with its *input* features split over ``device_ids``.

    ``forward(xs)`` takes the shards' input blocks ``(..., sizes[j])`` on ``devices[j]`` (what
    ``ColumnParallelLinear(gather_output=False)`` returns) or one tensor ``(..., in_features)``,
    split and sent to the shards. It returns ``(..., out_features)`` on the output device: the
    partial products summed in shard order (``nn.Linear``'s result up to float rounding) plus
    the bias, which lives on the output device.
    """

    def __init__(self, in_features: int, out_features: int, device_ids=None, bias: bool = True,
                 output_device=None, dtype=None):
        super().__init__(in_features, out_features, device_ids, output_device, in_features)
        # nn.Linear's U(-1/sqrt(fan_in), 1/sqrt(fan_in)), with the whole layer's fan_in
        bound = in_features ** -0.5
        for size, device in zip(self.sizes, self.devices):
            shard = nn.Linear(size, out_features, bias=False, device=device, dtype=dtype)
            nn.init.uniform_(shard.weight, -bound, bound)
            self.shards.append(shard)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, device=self.output_device,
                                                 dtype=dtype).uniform_(-bound, bound))
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, device_ids=None,
                    output_device=None) -> "RowParallelLinear":
        """Split ``linear`` by input features; its values are copied, it is not modified."""
        return cls._copy_of(linear, device_ids=device_ids, output_device=output_device)

    def plain_pieces(self) -> dict:
        """The weight split along its inputs, the bias whole (on the output device)."""
        pieces = {"weight": ([s.weight for s in self.shards], 1)}
        if self.bias is not None:
            pieces["bias"] = ([self.bias], None)
        return pieces

    def _inputs(self, xs) -> list[torch.Tensor]:
        if isinstance(xs, torch.Tensor):  # whole input on the output device: split, then send
            if xs.shape[-1] != self.in_features:
                raise UsageError(f"RowParallelLinear expected {self.in_features} input features, "
                                 f"got {xs.shape[-1]}")
            blocks = torch.split(xs, self.sizes, -1)
            return [move(b, d, self.home, j) for j, (b, d) in enumerate(zip(blocks, self.devices))]
        xs = list(xs)
        if [x.shape[-1] for x in xs] != self.sizes:
            raise UsageError(f"RowParallelLinear expected input blocks of {self.sizes} features "
                             f"(one per shard), got {[x.shape[-1] for x in xs]}")
        return xs

    def forward(self, xs):
        partials = self._run(self._inputs(xs))  # (..., out) on devices[j]
        # summed in shard order in float32 at least, as one matmul sums under autocast
        dtype = partials[0].dtype
        work = torch.promote_types(dtype, torch.float32)
        out = move(partials[0], self.output_device, 0, self.home).to(work)
        for j in range(1, len(partials)):
            out = out + move(partials[j], self.output_device, j, self.home).to(work)
        out = out if self.bias is None else out + self.bias.to(work)
        return out.to(dtype)  # (..., out)


class Shardwise(nn.Module):
    """Apply ``modules`` (in order) to every block of a sharded activation, in shard order.

    Only correct for elementwise modules (ReLU, Dropout, ...). Keyed dropout
    (:mod:`tandem.keyed`) draws each block's columns of the whole activation's mask (the plain
    layer's output bit for bit); torch's ``Dropout`` draws an independent mask per block.
    """

    def __init__(self, *modules: nn.Module):
        super().__init__()
        self.body = nn.Sequential(*modules)

    def forward(self, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        out, first = [], 0
        with keyed_stream.blocks() as block:
            for x in xs:  # x: (..., sizes[j]), features first .. first + sizes[j] - 1
                with block(first):
                    out.append(self.body(x))
                first += x.shape[-1]
        return out
