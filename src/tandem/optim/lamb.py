"""LAMB (You et al. 2019, Algorithm 2, φ the identity): Adam's update ``u = r + λ w`` per layer,
then ``w ← w − γ (‖w‖ / ‖u‖) u`` (ratio 1 where a norm is 0; ``trust=False``: Adam's step).
The norms are the plain model's (:class:`~tandem.plain_norms.PlainNorms`), one call a step.
"""

from __future__ import annotations

import torch

from tandem.plain_norms import PlainNorms

from .lars import TrustRatioOptimizer


class LAMB(TrustRatioOptimizer):
    """LAMB; ``norms``: the plain model's norms of ``params`` (default: each whole)."""

    def __init__(self, params, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, norms: PlainNorms | None = None):
        if lr <= 0 or not all(0 <= b < 1 for b in betas) or eps < 0 or weight_decay < 0:
            raise ValueError(f"LAMB: bad lr {lr}, betas {betas}, eps {eps} or weight decay "
                             f"{weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay), norms)

    def _step(self) -> None:
        todo = [(p, group) for group in self.param_groups for p in group["params"]
                if p.grad is not None]
        params = [p for p, _ in todo]
        updates = [self._update(p, group) for p, group in todo]
        weights, sizes = self.norms.squares(params, params, updates)
        for (p, group), update, w_square, u_square in zip(todo, updates, weights, sizes):
            if group["trust"]:
                w_norm, u_norm = w_square.sqrt(), u_square.sqrt()
                ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, 1.0)
                update.mul_(ratio.to(p.dtype))
            p.sub_(update, alpha=group["lr"])

    def _update(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        """``u`` for ``p``, its moments moved one step."""
        beta1, beta2 = group["betas"]
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        t, m, v = state["step"], state["exp_avg"], state["exp_avg_sq"]
        m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
        denominator = (v / (1 - beta2 ** t)).sqrt_().add_(group["eps"])
        update = (m / (1 - beta1 ** t)).div_(denominator)
        if group["weight_decay"]:
            update.add_(p, alpha=group["weight_decay"])
        return update
