"""The suite's own subprocess helper: a hung job fails its test with every process's stack, and
every process of it dies, also one in a session of its own (as torchrun starts its workers)."""

import sys
import time

import pytest
from conftest import alive, cli_env, run_bounded

HANG = """
import subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                          start_new_session=True)
def wait_forever():
    time.sleep(600)
print('worker pid:', worker.pid, flush=True)
wait_forever()
"""


def test_a_hung_job_fails_with_its_stacks_and_leaves_no_process():
    with pytest.raises(pytest.fail.Exception) as failed:
        run_bounded([sys.executable, "-c", HANG], 5, cli_env())
    message = str(failed.value)
    assert "did not end within 5s" in message
    assert "in wait_forever" in message  # faulthandler's dump of the main process
    worker = int(message.split("worker pid: ", 1)[1].split()[0])
    deadline = time.monotonic() + 10
    while alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(worker), f"process {worker} of the hung job is still running"


def test_a_finished_job_returns_its_output():
    proc = run_bounded([sys.executable, "-c", "print('hi'); raise SystemExit(3)"], 60, cli_env())
    assert (proc.returncode, proc.stdout) == (3, "hi\n")
