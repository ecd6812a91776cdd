"""Several `tandem` commands, one after the other, in each worker of ONE torchrun launch (the
launch and the workers' imports cost more than a short run): ``python -m ddp_runs JSON`` where
JSON is ``[[argv, busy], ...]``, or ``[argv, busy, "module:function"]`` to run that command
inside the context manager the function returns (a test's patch, e.g. a negative control of
``recipe_controls``). Each command joins, and leaves, its own process group; with ``busy``
true, rank 0 keeps 2 processes spinning on the CPU during that command. Rank 0 prints
``== run I`` before command I (``outputs`` splits the output by it); ``["copytree", SRC,
DST]`` is a copy rank 0 makes between commands. A command that fails ends the worker with its
exit status. ``launch_runs`` starts it from a test."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import subprocess
import sys


def launch_runs(runs: list[tuple], nproc: int = 2, timeout: float = 240, **env):
    """Run ``runs`` (``[(argv, busy), ...]``, or ``(argv, busy, "module:function")``) in one
    `tandem launch` of ``nproc`` workers."""
    from conftest import SUPPORT, cli_env, run_bounded

    code = ("import sys; from tandem.distributed.torchrun import LaunchSpec, launch; "
            f"sys.exit(launch(LaunchSpec(nproc_per_node={nproc}, command=sys.argv[1:], "
            "module='ddp_runs')))")
    payload = json.dumps([[[str(a) for a in argv], bool(busy), *patch]
                          for argv, busy, *patch in runs])
    env = cli_env(**env)
    env["PYTHONPATH"] = os.pathsep.join((str(SUPPORT), env["PYTHONPATH"]))  # -m ddp_runs
    return run_bounded([sys.executable, "-c", code, payload], timeout, env)


def outputs(stdout: str) -> list[str]:
    """Rank 0's output of each command of ``launch_runs``, in order."""
    return stdout.split("== run ")[1:]


def main(payload: str) -> int:
    from torch.distributed import distributed_c10d

    from tandem.cli.main import main as tandem

    rank = int(os.environ.get("RANK", "0"))
    for i, (argv, busy, *patch) in enumerate(json.loads(payload)):
        # torchrun's store outlives a process group, and a new default group would read the
        # last one's addresses under the same key prefix (the group count, reset to 0 on
        # leaving): a prefix of its own for each command
        distributed_c10d._world.group_count = 1000 * i
        if rank == 0:
            print(f"== run {i}", flush=True)
        if argv[0] == "copytree":
            if rank == 0:
                shutil.copytree(argv[1], argv[2])
            continue
        procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                 for _ in range(2 if busy and rank == 0 else 0)]
        try:
            with _patched(*patch):
                code = tandem(argv)
        finally:
            for p in procs:
                p.kill()
                p.wait(timeout=30)
        if code:
            return code
    return 0


def _patched(spec: str | None = None):
    """The context manager ``module:function`` returns (none without ``spec``)."""
    if spec is None:
        return contextlib.nullcontext()
    module, function = spec.split(":")
    return getattr(importlib.import_module(module), function)()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
