"""What happens to the replicas' buffers (batch-norm running statistics) after a parallel forward.

Every replica but the home one updates its own copy of each buffer, dropped at the next step.
``"replica0"`` keeps replica 0's updates, as ``torch.nn.DataParallel`` does. ``"average"`` writes
the chunk-size-weighted mean of all replicas' floating-point buffers (the variance ignores the
spread between chunk means); integer buffers keep replica 0's value.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from tandem.errors import UsageError

POLICIES = ("replica0", "average")


def check_policy(policy: str) -> str:
    """``policy`` if it names a buffer policy, else a ``UsageError`` listing them."""
    if not isinstance(policy, str) or policy not in POLICIES:
        raise UsageError(f"unknown buffers policy {policy!r}; choose one of: {', '.join(POLICIES)}")
    return policy


def _write(target: torch.Tensor, value: torch.Tensor) -> None:
    # Through ``.data``, untracked as batch norm's own update: autograd may have saved this
    # buffer for backward, and a tracked in-place write would fail its version check.
    target.data.copy_(value)


def sync_buffers(module: nn.Module, replicas: Sequence[nn.Module], weights: Sequence[float],
                 policy: str) -> None:
    """Apply ``policy`` to ``module``'s buffers after ``replicas`` (``replicas[i]`` ran a chunk
    of ``weights[i]`` samples; it may be ``module`` itself, whose updates are in place)."""
    if not replicas or (replicas[0] is module and (policy == "replica0" or len(replicas) < 2)):
        return  # replica 0 is the module: its updates are already in place
    originals = list(module.buffers())
    if not originals:
        return
    trees = [originals if r is module else list(r.buffers()) for r in replicas]
    total = float(sum(weights))
    with torch.no_grad():
        for j, b in enumerate(originals):
            base = trees[0][j]
            if policy == "replica0" or not b.is_floating_point():  # replica 0's value
                if base is not b:  # a detached home copy holds the originals themselves
                    _write(b, base)
                continue
            base = base.to(b.device)
            mean = base.clone()
            for weight, tree in zip(weights[1:], trees[1:]):
                mean.add_(tree[j].to(b.device) - base, alpha=weight / total)
            _write(b, mean)
