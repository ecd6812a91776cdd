"""Test-only: with TANDEM_INJECT_FAULT=RANK:STEP:MODE, make one ddp worker fail on purpose.

Put this directory first on PYTHONPATH of a `tandem launch` (every worker inherits it): Python
imports ``sitecustomize`` at start-up, and this one wraps ``DDPStrategy.forward_loss`` so that
the fault tests drive the real launch path. Production code carries no hook.
"""

import os

if os.environ.get("TANDEM_INJECT_FAULT"):
    import torch
    from faults import maybe_inject_fault

    from tandem.strategies.ddp import DDPStrategy

    _forward_loss = DDPStrategy.forward_loss

    def _faulty_forward_loss(self, wrapped, criterion, images, targets):
        if torch.is_grad_enabled() and wrapped.training:  # one count per training forward
            self.fault_steps = getattr(self, "fault_steps", 0) + 1
            maybe_inject_fault(self.rank, self.fault_steps)
        return _forward_loss(self, wrapped, criterion, images, targets)

    DDPStrategy.forward_loss = _faulty_forward_loss
