"""tandem.distributed: many processes, many machines, on torch.distributed.

- :mod:`.env` reads torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ...);
- :mod:`.process_group` joins the group (gloo on CPU, NCCL on ``cuda:LOCAL_RANK``) with a
  timeout, so no collective waits forever;
- :mod:`.global_loss` splits a mean loss into per-rank sums, for exact uneven shares;
- :mod:`.launch` builds and runs a ``torch.distributed.run`` (torchrun) job: we never write our
  own launcher or rendezvous;

The ``ddp`` strategy itself lives in :mod:`tandem.strategies.ddp`.
"""

from .env import DEFAULT_TIMEOUT, DistEnv, dist_timeout, in_torchrun, read_env
from .process_group import backend_for, destroy_process_group, init_process_group, pick_device

__all__ = ["DistEnv", "read_env", "in_torchrun", "dist_timeout", "DEFAULT_TIMEOUT",
           "backend_for", "init_process_group", "destroy_process_group", "pick_device"]
