"""Well-posed strategy-invariance checks, shared by the tests that compare runs with ``single``.

A float32 comparison of two strategies measures the update *and* how much the config amplifies
float32's last bit, which depends on the data and on the CPU (AVX-512 and AMX kernels round
differently). So the claim is checked in float64 (``--dtype float64``) at ``TOL64``, with two
controls that make the test fail only for a reason:

- noise floor: the float32 run's distance from the float64 run of the same strategy, divided by
  float32's epsilon, bounds how much this config amplifies rounding (float32 also crosses
  thresholds, ReLU and max-pool ties, that float64 rarely meets, so it over-estimates). Times
  float64's epsilon it must stay below ``TOL64 / 2``, else the config is ill-posed for the claim
  and the test says so instead of failing on a difference of rounding.
- negative control: a run that must differ (``dp`` without ``--sync-bn``, say) is at least
  ``1000 * TOL64`` away, so the comparison can see a real difference.
"""

from __future__ import annotations

import torch

__all__ = ["TOL64", "state", "max_diff", "check_invariance", "same_bits"]

TOL64 = 1e-9
EPS32 = torch.finfo(torch.float32).eps
EPS64 = torch.finfo(torch.float64).eps


def state(path) -> dict:
    """The checkpoint's model state (weights and buffers)."""
    return torch.load(path, weights_only=True)["state_dict"]


def max_diff(a: dict, b: dict) -> float:
    """The largest absolute difference over the floating-point tensors of two state dicts."""
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item()
               for k in a if a[k].is_floating_point() and a[k].numel())


def check_invariance(reference64, candidates: dict, *, reference32, negative64) -> dict:
    """Assert each candidate (float64 checkpoint path) is within ``TOL64`` of the reference,
    with both controls (module docstring). Returns the measured figures, for messages."""
    ref64 = state(reference64)
    amplification = max_diff(state(reference32), ref64) / EPS32
    floor = amplification * EPS64
    assert floor < TOL64 / 2, (
        f"ill-posed: this config amplifies rounding {amplification:.3g}x, so float64 noise "
        f"({floor:.3g}) is not far below the tolerance {TOL64}")
    figures = {"amplification": amplification, "float64 noise floor": floor}
    for name, path in candidates.items():
        diff = max_diff(state(path), ref64)
        figures[name] = diff
        assert diff < TOL64, f"{name} differs from the reference by {diff:.3g} (float64)"
    negative = max_diff(state(negative64), ref64)
    figures["negative control"] = negative
    assert negative > 1000 * TOL64, (
        f"negative control only {negative:.3g} from the reference: the comparison cannot "
        f"tell a different update apart")
    print("invariance figures:", {k: f"{v:.3g}" for k, v in figures.items()})  # pytest -s
    return figures


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes: equal bytes are equal bits (0.0 and -0.0 differ, NaN equals NaN)."""
    return t.detach().cpu().reshape(-1).contiguous().view(torch.uint8)


def same_bits(a: dict, b: dict, where: str = "") -> list[str]:
    """The keys (recursively) where two checkpoints differ in any bit or value."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(_bytes(a), _bytes(b)))
        return [] if same else [where or "<root>"]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"]
        return [d for k in a for d in same_bits(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in same_bits(x, y, f"{where}[{i}]")]
    return [] if a == b else [where or "<root>"]
