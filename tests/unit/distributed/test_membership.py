"""The elastic form's pieces without a network: the change line, what a checkpoint keeps of the
machines, the launch flags it takes and refuses, and a restarted worker of a changed job
continuing its run (tests/integration/two_machines/test_elastic.py runs it for real)."""

from __future__ import annotations

import pytest

from tandem.distributed import membership
from tandem.distributed.agree import Agreement
from tandem.distributed.env import LAUNCH_ID_VAR, LAUNCH_VAR, elastic_launch, place_of
from tandem.distributed.torchrun import LaunchSpec, torchrun_argv
from tandem.errors import UsageError

TWO = {"nodes": ["192.0.2.1", "192.0.2.2"], "processes": 2}
THREE = {"nodes": ["192.0.2.1", "192.0.2.2", "192.0.2.3"], "processes": 3}


def test_a_join_and_a_leave_are_one_line_each_with_their_cost():
    assert membership.change_line(TWO, THREE, 12, 12) == (
        "node 192.0.2.3 joined: 3 nodes, 3 processes; continuing from step 12 (the change cost "
        "no completed step)")
    assert membership.change_line(THREE, TWO, 20, 23) == (
        "node 192.0.2.3 left: 2 nodes, 2 processes; continuing from step 20 (the change cost 3 "
        "completed steps: 21-23 run again; --save-every bounds it)")
    swapped = {"nodes": ["192.0.2.1", "192.0.2.4"], "processes": 2}
    assert membership.change_line(TWO, swapped, 8, None) == (
        "node 192.0.2.4 joined, node 192.0.2.2 left: 2 nodes, 2 processes; continuing from "
        "step 8, the last checkpoint")
    more = {"nodes": TWO["nodes"], "processes": 4}
    assert membership.change_line(TWO, more, 8, 8).startswith(
        "2 processes became 4: 2 nodes, 4 processes;")


def test_no_line_when_nothing_changed_or_the_checkpoint_does_not_say():
    assert membership.change_line(TWO, dict(TWO), 5, 9) is None
    assert membership.change_line(None, TWO, 5, 5) is None  # saved before membership was kept
    assert membership.change_line({"nodes": []}, TWO, 5, 5) is None


def test_a_checkpoint_keeps_each_machine_once_and_the_processes():
    agreement = Agreement(rank=0, world_size=4)
    agreement.peers = {0: ("0", "192.0.2.2"), 1: ("0", "192.0.2.2"), 2: ("1", "192.0.2.1"),
                       3: ("1", "192.0.2.1")}
    assert membership.of(agreement) == {"nodes": ["192.0.2.1", "192.0.2.2"], "processes": 4}
    assert membership.completed_steps(Agreement(), 7) == 7  # one process: its own
    assert membership.completed_steps(Agreement(), None) is None


def test_the_elastic_form_needs_a_job_id_and_passes_the_rendezvous_settings_on():
    with pytest.raises(UsageError, match=r"nnodes 1:3 \(elastic\) needs (--rdzv-id|rdzv_id) JOB"):
        LaunchSpec(nproc_per_node=1, command=["train"], nnodes="1:3", rdzv_endpoint="h:1")
    spec = LaunchSpec(nproc_per_node=1, command=["train"], nnodes="1:3", rdzv_endpoint="h:1",
                      rdzv_id="job7", rdzv_conf="last_call_timeout=4")
    assert spec.elastic and not LaunchSpec(nproc_per_node=1, command=["train"]).elastic
    argv = torchrun_argv(spec, hosts_endpoint=True)
    assert argv[argv.index("--rdzv-conf") + 1] == "is_host=1,last_call_timeout=4"
    user_wins = LaunchSpec(nproc_per_node=1, command=["train"], rdzv_endpoint="h:1",
                           rdzv_conf="is_host=0")
    assert "is_host=0" in torchrun_argv(user_wins, hosts_endpoint=True)
    for bad in ("last_call_timeout", "=4"):
        with pytest.raises(UsageError, match=r"bad (--rdzv-conf|rdzv_conf) .*expected KEY=VALUE"):
            LaunchSpec(nproc_per_node=1, command=["train"], rdzv_endpoint="h:1", rdzv_conf=bad)
    with pytest.raises(UsageError, match=r"(--rdzv-conf|rdzv_conf) needs (--rdzv-endpoint|rdzv_endpoint)"):
        LaunchSpec(nproc_per_node=1, command=["train"], rdzv_conf="a=1")


def _worker_env(nnodes: str, restart: int = 0) -> dict:
    """A worker's variables as `tandem launch --nnodes NNODES --rdzv-endpoint h:1` sets them."""
    launch = LaunchSpec(nproc_per_node=1, command=["train"], nnodes=nnodes, rdzv_endpoint="h:1",
                        rdzv_id="j").described()
    return {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", LAUNCH_VAR: launch,
            LAUNCH_ID_VAR: "j@h:1:", "TORCHELASTIC_RESTART_COUNT": str(restart)}


def test_a_worker_knows_it_runs_in_the_elastic_form():
    assert place_of(_worker_env("1:3")).elastic
    assert not place_of(_worker_env("2")).elastic and not place_of(_worker_env("2:2")).elastic
    assert not elastic_launch(None)


def test_after_a_change_of_nodes_rank_0_continues_its_launchs_run_and_no_other(tmp_path):
    """A change of nodes restarts the workers without counting a restart: rank 0 goes on with
    the run this launch started; a run another launch left is refused as before."""
    from tandem.config import TrainConfig
    from tandem.train import settings
    from tandem.train.rundir import RunDir

    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoint.pt").write_bytes(b"x")
    cfg = TrainConfig.from_dict({"run": {"out": str(out)}})
    RunDir(str(out)).write_config({"resolved": {"launch_id": "j@h:1:"}})
    assert settings._decide(cfg, place_of(_worker_env("1:3"))) == (str(out / "checkpoint.pt"),
                                                                   True)
    assert settings._decide(cfg, place_of(_worker_env("2"))) == (None, False)  # fresh: refused later
    RunDir(str(out)).write_config({"resolved": {"launch_id": "another@h:1:"}})
    assert settings._decide(cfg, place_of(_worker_env("1:3"))) == (None, False)


def test_a_newcomer_that_became_rank_0_refuses_rather_than_start_afresh(tmp_path):
    """The rendezvous ranks the nodes by address: a joining node may be rank 0 without the
    run; every rank refuses in one line (naming who holds it) instead of a fresh run."""
    from tandem.config import TrainConfig
    from tandem.train import settings
    from tandem.train.rundir import RunDir

    class Heard(Agreement):  # what each rank's machine said, as the collective would gather it
        def __init__(self, said, rank):
            super().__init__(rank=rank, world_size=len(said))
            self.said = said

        def each(self, value):
            return [value if r == self.rank else s for r, s in enumerate(self.said)]

    out = tmp_path / "run"
    cfg = TrainConfig.from_dict({"run": {"out": str(out)}})
    place = place_of(_worker_env("1:3"))
    settings._check_rank0_holds_the_run(cfg, place, Heard([False, False], 0))  # a fresh job
    with pytest.raises(UsageError, match=r"rank 0 \(node 0\) holds no run of this launch in .*, rank 1 "
                                         r"does: a node that joined became rank 0\nhint: "):
        settings._check_rank0_holds_the_run(cfg, place, Heard([False, True], 0))
    out.mkdir()
    RunDir(str(out)).write_config({"resolved": {"launch_id": "j@h:1:"}})
    settings._check_rank0_holds_the_run(cfg, place, Heard([True, False], 0))  # rank 0 has it


def test_the_ranks_meet_under_one_prefix_whatever_restart_each_node_counts():
    """In one round of a changed job one node may count a restart (its workers failed) and
    another not (its agent saw a node waiting): on a store of the workers' own, new each round,
    the keys do not carry the count; on torchrun's agent store, kept across restarts, they do."""
    from tandem.distributed.env import read_env
    from tandem.distributed.join import key_prefix

    counted, not_counted = (read_env(_worker_env("1:3", restart)) for restart in (1, 0))
    assert key_prefix(counted) == key_prefix(not_counted)
    shared = {**_worker_env("2", 1), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    assert key_prefix(read_env(shared)) == "tandem/1"
