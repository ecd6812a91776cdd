"""Test-only hooks in every ``tandem`` subprocess of the suite (``cli_env`` puts this directory
first on PYTHONPATH, and Python imports ``sitecustomize`` at start-up):

- SIGUSR1 prints every thread's Python stack to stderr, so a test whose subprocess times out
  can show where each process of the job was (``conftest.run_bounded``);
- with ``TANDEM_INJECT_FAULT=RANK:STEP:MODE`` one worker of a multi-process strategy fails on
  purpose (``faults.py``): each such strategy's own ``forward_loss`` is wrapped, so the fault
  tests drive the real launch path;
- with ``TANDEM_SIMULATE_NCCL_ABORT=1`` the gloo workers meet a lost peer as NCCL's workers
  do: the moment tandem learns that a collective failed because of a peer, the process
  aborts (SIGABRT) instead of raising, as NCCL's watchdog ends it; the strategies declare
  that failure model (``failure_model``), as ddp does on CUDA;
- with ``TANDEM_SLOW_WRITE=SECONDS`` every file rank 0 writes off the step's path takes that
  much longer (a slow disk);
- with ``TANDEM_SLOW_STEP=SECONDS`` every training forward of a multi-process strategy takes
  that much longer (so that a test's signal lands at a step it knows).

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
        def faulty_forward_loss(self, wrapped, criterion, images, targets, **kw):
            if torch.is_grad_enabled() and wrapped.training:  # one count per training forward
                self.fault_steps = getattr(self, "fault_steps", 0) + 1
                maybe_inject_fault(self.rank, self.fault_steps)
            return forward_loss(self, wrapped, criterion, images, targets, **kw)
        return faulty_forward_loss

    for _name in strategy_names(multiprocess=True):
        _cls = strategy_class(_name)
        if "forward_loss" in vars(_cls):  # its own, not one a wrapped parent already counts
            _cls.forward_loss = _faulty(vars(_cls)["forward_loss"])

if os.environ.get("TANDEM_SIMULATE_NCCL_ABORT") == "1":
    import sys

    from tandem.distributed import faults
    from tandem.strategies import strategy_class, strategy_names

    _lost_peer = faults.lost_peer

    def _aborting_lost_peer(exc, agreement, where):
        lost = _lost_peer(exc, agreement, where)
        if lost is not None:
            print(f"[simulated NCCL watchdog] rank {agreement.rank}: a collective failed "
                  f"({faults.why(exc)}); aborting", file=sys.stderr, flush=True)
            os.abort()
        return lost

    faults.lost_peer = _aborting_lost_peer
    for _name in strategy_names(multiprocess=True):
        strategy_class(_name).failure_model = property(lambda self: faults.ABORTS)

if os.environ.get("TANDEM_SLOW_STEP"):
    import time

    import torch

    from tandem.strategies import strategy_class, strategy_names

    _step_pause = float(os.environ["TANDEM_SLOW_STEP"])

    def _slow(forward_loss):
        def slow_forward_loss(self, wrapped, criterion, images, targets, **kw):
            if torch.is_grad_enabled() and wrapped.training:
                time.sleep(_step_pause)
            return forward_loss(self, wrapped, criterion, images, targets, **kw)
        return slow_forward_loss

    for _name in strategy_names(multiprocess=True):
        _cls = strategy_class(_name)
        if "forward_loss" in vars(_cls):
            _cls.forward_loss = _slow(vars(_cls)["forward_loss"])

if os.environ.get("TANDEM_SLOW_WRITE"):
    import time

    from tandem.train import writer

    _write = writer.Writer.write
    _pause = float(os.environ["TANDEM_SLOW_WRITE"])

    def _slow_write(self, what, job, step=None, **kw):
        def slowly():
            time.sleep(_pause)
            job()
        return _write(self, what, slowly, step, **kw)

    writer.Writer.write = _slow_write
