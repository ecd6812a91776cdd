"""Replica threads without DataParallel: ``run_threads`` runs one function per replica under its
own ReplicaContext, the harness of tests/unit/parallel/test_sync_batchnorm.py, and of the
replica threads inside each process of tests/integration/torchrun/test_sync_batchnorm_dist.py."""

import threading

import torch

from tandem.parallel import context
from tandem.parallel.context import ReplicaContext, ReplicaGroup

CPU = torch.device("cpu")


def run_threads(fns, timeout=60.0, devices=None):
    """Run fns[i]() in thread i under ReplicaContext(i); abort the group when one fails."""
    group = ReplicaGroup(devices or [CPU] * len(fns), timeout=timeout)
    results, errors = [None] * len(fns), [None] * len(fns)

    def work(i):
        try:
            with context.use(ReplicaContext(i, group.devices[i], group)):
                results[i] = fns[i]()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            errors[i] = exc
            group.abort(exc)

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a replica thread hung"
    return results, errors
