"""tandem.distributed: many processes, many machines, on torch.distributed.

:mod:`.env` reads torchrun's environment, :mod:`.process_group` joins with a timeout,
:mod:`.global_loss` splits a loss into per-rank sums, :mod:`.torchrun` runs torchrun.
"""

from .env import DEFAULT_TIMEOUT, DistEnv, dist_timeout, in_torchrun, read_env
from .process_group import backend_for, destroy_process_group, init_process_group, pick_device

__all__ = ["DistEnv", "read_env", "in_torchrun", "dist_timeout", "DEFAULT_TIMEOUT",
           "backend_for", "init_process_group", "destroy_process_group", "pick_device"]
