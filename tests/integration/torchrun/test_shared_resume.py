"""Rank 0's checkpoint sent to a machine that lacks it, against rank 0's bytes: 4 gloo processes
as 2 machines of 2 (each machine its own directory), the receiving machine's first rank writing
slowly; every rank reads rank 0's bytes (its other rank once read before the file was there).

This file is both the pytest module and the worker program: the test starts 4 processes of it
with torchrun's variables set by hand (2 local ranks a machine), each prints what it read."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def _worker() -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from tandem.distributed import shared_resume
    from tandem.distributed.agree import Agreement
    from tandem.distributed.env import read_env

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=4, timeout=timedelta(seconds=60))
    if rank == 2:  # the receiving machine's first rank: a slow disk
        replace = os.replace
        shared_resume.os.replace = lambda a, b: (time.sleep(2), replace(a, b))[1]
    continued = shared_resume.continue_from_rank0(lambda: ("ck.pt", False), Agreement(rank, 4, env=read_env(os.environ)))
    with open(continued.local, "rb") as f:
        read = f.read().decode()
    shared_resume.done_with(continued, Agreement(rank, 4, env=read_env(os.environ)))
    print(json.dumps({"rank": rank, "read": read, "sent": continued.sent}), flush=True)
    dist.destroy_process_group()


def test_every_rank_of_a_machine_without_the_checkpoint_reads_rank_0_s_bytes(tmp_path):
    from conftest import cli_env

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for node in (0, 1):
        (tmp_path / f"node{node}").mkdir()
    (tmp_path / "node0" / "ck.pt").write_text("rank 0's checkpoint")
    procs = []
    for rank in range(4):
        env = cli_env(RANK=str(rank), WORLD_SIZE="4", LOCAL_RANK=str(rank % 2),
                      LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_RESTART_COUNT="0")
        procs.append(subprocess.Popen([sys.executable, __file__], env=env, text=True,
                                      cwd=tmp_path / f"node{rank // 2}", stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE))
    try:
        results = [proc.communicate(timeout=180) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    failed = [f"rank {r}: {err[-1500:]}"
              for r, (proc, (_, err)) in enumerate(zip(procs, results)) if proc.returncode]
    assert not failed, "\n".join(failed)
    read = [json.loads(out.splitlines()[-1]) for out, _ in results]
    assert [r["read"] for r in read] == ["rank 0's checkpoint"] * 4
    assert all(r["sent"] for r in read)
    assert not (tmp_path / "node1" / "ck.pt").exists()  # the copy went to a temporary file


if __name__ == "__main__":
    _worker()
