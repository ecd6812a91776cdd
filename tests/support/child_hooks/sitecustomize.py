"""Test-only hooks in every ``tandem`` subprocess of the suite (``cli_env`` puts this directory
first on PYTHONPATH, and Python imports ``sitecustomize`` at start-up):

- SIGUSR1 prints every thread's Python stack to stderr, so a test whose subprocess times out
  can show where each process of the job was (``conftest.run_bounded``);
- with ``TANDEM_INJECT_FAULT=RANK:STEP:MODE`` one worker of a multi-process strategy fails on
  purpose (``faults.py``): each such strategy's own ``forward_loss`` is wrapped, so the fault
  tests drive the real launch path.

Production code carries no hook.
"""

import faulthandler
import os
import signal

faulthandler.register(signal.SIGUSR1, all_threads=True)

if os.environ.get("TANDEM_INJECT_FAULT"):
    import torch
    from faults import maybe_inject_fault

    from tandem.strategies import strategy_class, strategy_names

    def _faulty(forward_loss):
        def faulty_forward_loss(self, wrapped, criterion, images, targets):
            if torch.is_grad_enabled() and wrapped.training:  # one count per training forward
                self.fault_steps = getattr(self, "fault_steps", 0) + 1
                maybe_inject_fault(self.rank, self.fault_steps)
            return forward_loss(self, wrapped, criterion, images, targets)
        return faulty_forward_loss

    for _name in strategy_names(multiprocess=True):
        _cls = strategy_class(_name)
        if "forward_loss" in vars(_cls):  # its own, not one a wrapped parent already counts
            _cls.forward_loss = _faulty(vars(_cls)["forward_loss"])
