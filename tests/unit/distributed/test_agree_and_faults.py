"""The one agreement in one process (each decision is the caller's own), a lost peer told apart
from a bug by the transport's own text, and the lost ranks named from the job's table or from
who still answers in the job's store; compared with what gloo itself raises."""

import os
import socket
import subprocess
import sys
import textwrap
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tandem.distributed import faults
from tandem.distributed.agree import LOCAL, Agreement, Verdict
from tandem.distributed.env import Environment, read_env

GLOO_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
               "Connection closed by peer [192.0.2.2]:23979. This is typically caused by a "
               "remote worker crashing.")
GLOO_TIMEOUT = ("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out "
                "waiting 20000ms for recv operation to complete")


def test_one_process_decides_alone_and_sends_nothing():
    assert not LOCAL.several
    assert LOCAL.vote(True, False, 4) == Verdict(True, False, 4)  # this step's own, at once
    assert LOCAL.settle() == Verdict()
    assert LOCAL.all_of([True, False]) == [True, False] and LOCAL.any_of(True)
    assert LOCAL.rank0(lambda: 7) == 7 and LOCAL.from_rank0("x") == "x" and LOCAL.each(3) == [3]
    LOCAL.settings({"optim.lr": 0.1})  # nothing to compare with
    assert type(LOCAL.grad_scaler("cpu", True)) is torch.amp.GradScaler


def test_a_lost_peer_is_the_transport_s_words_from_the_transport_not_any_eof():
    assert faults.is_peer_failure(RuntimeError(GLOO_CLOSED))
    assert faults.is_peer_failure(RuntimeError(GLOO_TIMEOUT))
    assert faults.is_peer_failure(dist.DistNetworkError("the store went away"))
    # a data file's or an image decoder's failure says "EOF" or "read error": not a peer
    assert not faults.is_peer_failure(RuntimeError("unexpected EOF, expected 1024 more bytes"))
    assert not faults.is_peer_failure(RuntimeError("image file is truncated: read error"))
    assert not faults.is_peer_failure(ValueError(GLOO_CLOSED))  # a bug's type stays a bug


def _real_gloo_error() -> str:
    """What gloo raises in the survivor when its peer dies (a real 2-process job)."""
    code = textwrap.dedent("""
        import os, sys, torch, torch.distributed as dist
        from datetime import timedelta
        r = int(sys.argv[1])
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=r,
                                world_size=2, timeout=timedelta(seconds=20))
        t = torch.ones(1)
        dist.all_reduce(t)
        if r == 1:
            os._exit(0)
        try:
            dist.all_reduce(t)
        except RuntimeError as exc:
            print(str(exc).splitlines()[0])
        os._exit(0)
    """)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    peer = subprocess.Popen([sys.executable, "-c", code, "1", port], env=env)
    try:
        out = subprocess.run([sys.executable, "-c", code, "0", port], env=env, timeout=120,
                             capture_output=True, text=True).stdout
    finally:
        peer.wait(timeout=60)
    return out.strip()


@pytest.mark.distributed
def test_what_gloo_raises_for_a_dead_peer_is_a_lost_peer_named_by_its_address():
    text = _real_gloo_error()
    assert text, "the survivor's collective did not fail"
    agreement = Agreement(0, 2)
    agreement.peers = {0: ("0", "127.0.0.2"), 1: ("1", "127.0.0.1")}
    lost = faults.lost_peer(RuntimeError(text), agreement, "in step 9")
    assert lost is not None and lost.lost == (1,)
    assert str(lost).startswith("rank 0 (node 0, 127.0.0.2): lost rank 1 (node 1, 127.0.0.1) "
                                "in step 9: connection")


def test_a_timeout_names_the_ranks_that_no_longer_answer_in_the_job_s_store(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=5))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setattr(faults, "_ROLL_S", 0.5)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # keys under the restart's count
    store.set("tandem/0/alive/2", "1")  # rank 2 survived and said so; rank 1 is silent
    agreement = Agreement(0, 3, env=read_env(Environment.read()))
    agreement.peers = {0: ("0", "192.0.2.1"), 1: ("1", "192.0.2.2"), 2: ("1", "192.0.2.2")}
    lost = faults.lost_peer(RuntimeError(GLOO_TIMEOUT), agreement, "after step 3")
    assert lost.lost == (1,)
    assert str(lost) == ("rank 0 (node 0, 192.0.2.1): lost rank 1 (node 1, 192.0.2.2) after "
                         "step 3: no answer for 20 s (--dist-timeout)")
    assert store.check(["tandem/0/alive/0"])  # this survivor marked itself, once


def test_a_store_out_of_reach_means_node_0_and_its_ranks_are_lost(monkeypatch):
    with socket.socket() as s:  # nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for var, value in dict(RANK="2", WORLD_SIZE="3", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(port)).items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(faults, "_ROLL_S", 0.5)
    agreement = Agreement(2, 3, env=read_env(Environment.read()))
    agreement.peers = {0: ("0", "192.0.2.1"), 1: ("0", "192.0.2.1"), 2: ("1", "192.0.2.2")}
    assert faults.lost_peer(RuntimeError(GLOO_TIMEOUT), agreement, "in step 2").lost == (0, 1)


def test_the_store_keeps_the_first_rank_s_own_line_and_no_survivor_s_lost_peer(monkeypatch):
    """Every survivor once left its lost-peer line there, each replacing the one before: the
    next survivor then quoted another's loss as the cause (at 8 ranks, 3 deep: "rank 4: the
    job cannot go on: rank 5 (node 2): rank 5 ...: the job cannot go on: rank 6 ...: lost rank
    7 ...", with other nodes' commands). A lost peer leaves nothing; a rank's own failure
    stays as the first one said it."""
    from tandem.cli import main as cli
    from tandem.distributed.join import announce_failure, told_failure

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=5))
    for var, value in dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(port), TANDEM_NODE_RANK="1").items():
        monkeypatch.setenv(var, value)

    def lost(args):
        raise faults.PeerLost("rank 1 (node 1, 192.0.2.2): lost rank 0 in step 3: connection "
                              "reset by peer")

    monkeypatch.setattr("tandem.cli.models.run", lost)
    assert cli.main(["models"]) == 4
    env = read_env(Environment.read())
    assert told_failure(env, store) is None
    announce_failure("data/train: no such directory", env)
    announce_failure("the job cannot go on: rank 0 (node 0): data/train: no such directory", env)
    assert told_failure(env, store) == "rank 1 (node 1): data/train: no such directory"


_WATCHED = textwrap.dedent("""
    import os, sys, time
    from tandem.distributed.env import Environment, read_env
    from tandem.distributed.join import abandoned_if_another_fails
    with abandoned_if_another_fails(read_env(Environment.read())):
        print("connecting", flush=True)
        time.sleep(float(sys.argv[1]))  # torch making the group's connections
    print("connected", flush=True)
""")
_STORE = textwrap.dedent("""
    import sys, time
    from datetime import timedelta
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True,
                          wait_for_workers=False, timeout=timedelta(seconds=30))
    print("serving", flush=True)
    time.sleep(120)
""")


@pytest.mark.parametrize("store_ends", [True, False], ids=["store_gone", "store_stays"])
def test_a_rank_making_its_connections_ends_in_one_line_when_the_job_s_store_is_gone(store_ends):
    """The rank that failed the connect left its line and ended, and its node's launcher took
    the job's store with it before this rank read the line: this rank ended only after gloo's
    300 s connect timeout (node 1 of the loopback two-machine test, under load). Now a store
    that is gone ends it in one line, exit 4; a store that stays leaves the connect alone."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TANDEM_NODE_RANK": "1"}
    store = subprocess.Popen([sys.executable, "-c", _STORE, str(port)], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert store.stdout.readline() == "serving\n"
        rank = subprocess.Popen([sys.executable, "-c", _WATCHED, "60" if store_ends else "3"],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        try:
            assert rank.stdout.readline() == "connecting\n"
            if store_ends:
                store.kill()
                store.wait(30)
            out, err = rank.communicate(timeout=50)
        finally:
            rank.kill()
    finally:
        store.kill()
        store.wait(30)
    if store_ends:
        assert rank.returncode == 4 and out == "", (out, err)
        assert err.splitlines()[-1] == (
            f"tandem: error: rank 1 (node 1): the job cannot start: the job's store at "
            f"127.0.0.1:{port} is gone (its node ended) while the ranks connected"), err
    else:
        assert rank.returncode == 0 and out == "connected\n", (out, err)
