"""LARS (You, Gitman and Ginsburg 2017, Algorithm 1): ``λ = η ‖w‖ / (‖g‖ + β ‖w‖ + ε)``,
``v ← m v + γ λ (g + β w)``, ``w ← w − v`` (the learning rate inside the momentum, as in the
paper; ratio 1 where a norm is 0; ``trust=False``: ``λ = 1``). The norms are the plain model's.
"""

from __future__ import annotations

import torch

from tandem.plain_norms import PlainNorms


class TrustRatioOptimizer(torch.optim.Optimizer):
    """LARS's and LAMB's base: ``defaults`` and ``trust=True`` per group, the plain model's
    ``norms`` of ``params`` (default: each whole), and the closure run with grad enabled."""

    def __init__(self, params, defaults: dict, norms: PlainNorms | None):
        super().__init__(params, dict(defaults, trust=True))
        self.norms = norms or PlainNorms(p for g in self.param_groups for p in g["params"])

    @torch.no_grad()
    def step(self, closure=None):
        with torch.enable_grad():
            loss = None if closure is None else closure()
        self._step()
        return loss


class LARS(TrustRatioOptimizer):
    """LARS; ``norms``: the plain model's norms of ``params`` (default: each whole)."""

    def __init__(self, params, lr: float, momentum: float = 0.9, weight_decay: float = 0.0,
                 trust_coefficient: float = 0.001, eps: float = 1e-8,
                 norms: PlainNorms | None = None):
        if lr <= 0 or not 0 <= momentum < 1 or weight_decay < 0 or trust_coefficient <= 0 \
                or eps < 0:
            raise ValueError(f"LARS: bad lr {lr}, momentum {momentum}, weight decay "
                             f"{weight_decay}, trust coefficient {trust_coefficient} or eps {eps}")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      trust_coefficient=trust_coefficient, eps=eps), norms)

    def _step(self) -> None:
        todo = [(p, group) for group in self.param_groups for p in group["params"]
                if p.grad is not None]
        params = [p for p, _ in todo]
        weights, grads = self.norms.squares(params, params, [p.grad for p in params])
        for (p, group), w_square, g_square in zip(todo, weights, grads):
            decay = group["weight_decay"]
            direction = p.grad.add(p, alpha=decay) if decay else p.grad.clone()
            if group["trust"]:
                w_norm, g_norm = w_square.sqrt(), g_square.sqrt()
                ratio = group["trust_coefficient"] * w_norm / (
                    g_norm + decay * w_norm + group["eps"])
                ratio = torch.where((w_norm > 0) & (g_norm > 0), ratio, 1.0)
                direction.mul_(ratio.to(p.dtype))
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            buffer = state["momentum_buffer"]
            buffer.mul_(group["momentum"]).add_(direction, alpha=group["lr"])
            p.sub_(buffer)
