"""tandem.distributed without extra processes: env parsing, device choice, loss split, faults,
the launch argv, and a world-size-1 ddp strategy in this process (gloo on a free port)."""

from __future__ import annotations

import socket

import pytest
import torch
from torch import nn

from tandem.distributed.env import (DEFAULT_TIMEOUT, LAUNCH_ID_VAR, DistEnv, Environment,
                                    dist_timeout, in_torchrun, place_of, read_env)
from child_hooks.faults import maybe_inject_fault, parse_fault
from tandem.distributed.global_loss import local_sum
from tandem.distributed.torchrun import LaunchSpec, check_port_free, torchrun_argv
from tandem.distributed.process_group import backend_for, pick_device

ENV = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
       "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
CPU = torch.device("cpu")


# -- env ---------------------------------------------------------------------------------------
def test_read_env_parses_torchrun_variables():
    env = read_env(ENV)
    assert env == DistEnv(1, 4, 1, 2, "10.0.0.1", 29500, addr=socket.gethostname())
    assert in_torchrun(ENV) and not in_torchrun({})


def test_local_world_size_defaults_to_world_size():
    env = {k: v for k, v in ENV.items() if k != "LOCAL_WORLD_SIZE"}
    assert read_env(env).local_world_size == 4


def test_missing_env_names_variables_and_says_how_to_launch():
    with pytest.raises(ValueError) as info:
        read_env({"RANK": "0"})
    error, hint = str(info.value).split("\n")  # the error, and how to launch on a line of its own
    assert "WORLD_SIZE" in error and "MASTER_PORT" in error
    assert hint.startswith("hint: run it with `tandem launch --nproc-per-node N -- train")


@pytest.mark.parametrize("key, value, words", [
    ("RANK", "4", "RANK=4"), ("RANK", "x", "RANK='x'"), ("WORLD_SIZE", "0", "WORLD_SIZE=0"),
    ("LOCAL_RANK", "2", "LOCAL_RANK=2"), ("MASTER_PORT", "70000", "MASTER_PORT=70000"),
    ("LOCAL_WORLD_SIZE", "8", "exceeds WORLD_SIZE"),
])
def test_inconsistent_env_is_a_named_error(key, value, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        read_env({**ENV, key: value})


def test_dist_timeout():
    assert dist_timeout({}) == DEFAULT_TIMEOUT
    assert dist_timeout({"TANDEM_DIST_TIMEOUT": "7.5"}) == 7.5
    for bad in ("0", "-1", "soon"):
        with pytest.raises(ValueError, match="TANDEM_DIST_TIMEOUT"):
            dist_timeout({"TANDEM_DIST_TIMEOUT": bad})


def test_launch_id_is_tandem_launchs_or_none():
    assert place_of({LAUNCH_ID_VAR: "abc"}).launch_id == "abc"
    assert place_of({}).launch_id is None and place_of({LAUNCH_ID_VAR: ""}).launch_id is None


# -- devices -----------------------------------------------------------------------------------
def test_pick_device_cpu_and_errors():
    env = read_env(ENV)
    assert pick_device(env, [CPU]) == CPU
    with pytest.raises(ValueError, match="one device per process"):
        pick_device(env, [CPU, CPU])
    with pytest.raises(ValueError, match="empty"):
        pick_device(env, [])
    assert backend_for(CPU) == "gloo" and backend_for(torch.device("cuda", 0)) == "nccl"


def test_pick_device_takes_entry_local_rank_of_an_accelerator_list():
    # torch.device("cuda", i) can be built without CUDA; pick_device does not touch the GPU.
    gpus = [torch.device("cuda", i) for i in (2, 3)]
    assert pick_device(read_env(ENV), gpus) == torch.device("cuda", 3)
    with pytest.raises(ValueError, match="LOCAL_RANK=1 but devices lists only 1"):
        pick_device(read_env(ENV), gpus[:1])
    one = read_env({**ENV, "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
    assert pick_device(one, [torch.device("cuda", 5)]) == torch.device("cuda", 5)


# -- loss split --------------------------------------------------------------------------------
CRITERIA = {
    "ce": (nn.CrossEntropyLoss(), "index"),
    "ce_weight_ignore_smooth": (nn.CrossEntropyLoss(weight=torch.rand(5), ignore_index=2,
                                                    label_smoothing=0.1), "index"),
    "ce_probabilities": (nn.CrossEntropyLoss(), "probs"),
    "nll_weight": (nn.NLLLoss(weight=torch.rand(5)), "index"),
    "ce_sum": (nn.CrossEntropyLoss(reduction="sum"), "index"),
    "mse": (nn.MSELoss(), "dense"),
    "multi_margin": (nn.MultiMarginLoss(), "index"),
    "kl_batchmean": (nn.KLDivLoss(reduction="batchmean"), "dense"),
    "function": (nn.functional.cross_entropy, "index"),
}


@pytest.mark.parametrize("name", list(CRITERIA))
@pytest.mark.parametrize("split", [[3, 4], [0, 7], [1, 0, 6], [2, 2, 2, 1]])
def test_summed_shares_give_the_whole_batch_loss(name, split):
    criterion, kind = CRITERIA[name]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 5, generator=g, dtype=torch.float64, requires_grad=True)
    t = {"index": torch.tensor([0, 1, 2, 3, 4, 1, 2]),
         "probs": torch.rand(7, 5, generator=g, dtype=torch.float64).softmax(1),
         "dense": torch.rand(7, 5, generator=g, dtype=torch.float64)}[kind]
    if name == "nll_weight":
        criterion.weight = criterion.weight.double()
    if name == "ce_weight_ignore_smooth":
        criterion.weight = criterion.weight.double()
    whole = criterion(x, t)
    (whole_grad,) = torch.autograd.grad(whole, x)
    total, den = 0.0, 0.0
    for xs, ts in zip(x.split(split), t.split(split)):
        s, d = local_sum(criterion, xs, ts)
        total, den = total + s, den + d
    mean = total if getattr(criterion, "reduction", "mean") == "sum" else total / den
    (grad,) = torch.autograd.grad(mean, x)
    torch.testing.assert_close(mean, whole)
    torch.testing.assert_close(grad, whole_grad)


def test_empty_share_is_zero_but_reaches_every_parameter():
    model = nn.Linear(3, 2)
    s, d = local_sum(nn.CrossEntropyLoss(), model(torch.empty(0, 3)), torch.empty(0).long())
    s.backward()
    assert float(s.detach()) == 0 and float(d) == 0
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_reduction_none_is_refused():
    with pytest.raises(ValueError, match="reduction='none'"):
        local_sum(nn.CrossEntropyLoss(reduction="none"), torch.randn(2, 3), torch.tensor([0, 1]))


# -- faults ------------------------------------------------------------------------------------
def test_fault_hook():
    assert parse_fault("1:2:raise") == (1, 2, "raise")
    for bad in ("1:2", "a:2:raise", "1:2:explode"):
        with pytest.raises(ValueError, match="TANDEM_INJECT_FAULT"):
            parse_fault(bad)
    env = {"TANDEM_INJECT_FAULT": "1:2:raise"}
    maybe_inject_fault(0, 2, env)  # other rank: nothing
    maybe_inject_fault(1, 1, env)  # other step: nothing
    maybe_inject_fault(1, 2, {})  # unset: nothing
    with pytest.raises(RuntimeError, match="injected fault on rank 1 at step 2"):
        maybe_inject_fault(1, 2, env)


# -- launch argv and port check ----------------------------------------------------------------
def test_torchrun_argv_single_node_lets_torchrun_pick_the_port():
    """On every torch version: older torchrun's default is a fixed port (29500)."""
    argv = torchrun_argv(LaunchSpec(nproc_per_node=2, command=["train", "--strategy", "ddp"]))
    assert "--master-port" not in argv and "--standalone" in argv
    assert argv[argv.index("--local-addr") + 1] == "127.0.0.1"
    fixed = torchrun_argv(LaunchSpec(nproc_per_node=2, command=["eval"], master_port=29400))
    assert "--standalone" not in fixed and fixed[fixed.index("--master-port") + 1] == "29400"
    assert argv[-5:] == ["-m", "tandem", "train", "--strategy", "ddp"]
    assert argv[argv.index("--nproc-per-node") + 1] == "2"


def test_torchrun_argv_multi_node_and_rendezvous():
    spec = LaunchSpec(nproc_per_node=4, command=["train", "--strategy=ddp"], nnodes="2",
                      node_rank=1,
                      master_addr="h0", master_port=29400, max_restarts=2)
    argv = torchrun_argv(spec)
    for flag, value in [("--nnodes", "2"), ("--node-rank", "1"), ("--master-addr", "h0"),
                        ("--master-port", "29400"), ("--max-restarts", "2")]:
        assert argv[argv.index(flag) + 1] == value
    rdzv = torchrun_argv(LaunchSpec(nproc_per_node=1, command=["eval"], nnodes="1:3",
                                    rdzv_endpoint="h0:29400", rdzv_id="job7"))
    assert rdzv[rdzv.index("--rdzv-backend") + 1] == "c10d"
    assert rdzv[rdzv.index("--rdzv-id") + 1] == "job7" and "--master-addr" not in rdzv


def test_torchrun_argv_for_another_module():
    """The bench's workers run a module of their own; only tandem's needs a subcommand."""
    spec = LaunchSpec(nproc_per_node=2, command=["--out", "o.json"], module="pkg.worker",
                      rdzv_endpoint="127.0.0.1:0")
    assert torchrun_argv(spec)[-4:] == ["-m", "pkg.worker", "--out", "o.json"]
    with pytest.raises(ValueError, match="must be a tandem subcommand"):
        LaunchSpec(nproc_per_node=2, command=["--out", "o.json"])


def test_check_port_free():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ValueError, match=f"port {port} on 127.0.0.1 is already in use"):
            check_port_free("127.0.0.1", port)
    check_port_free("127.0.0.1", port)  # closed again: free


# -- the strategy in one process ---------------------------------------------------------------
def test_ddp_without_torchrun_env_is_one_line(monkeypatch):
    from tandem.strategies import create_strategy

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="needs torchrun's environment") as info:
        create_strategy("ddp", [CPU])
    error, hint = str(info.value).split("\n")  # the error, and how to launch it
    assert hint.startswith("hint: run it with `tandem launch")


@pytest.mark.distributed
def test_world_size_one_ddp_equals_plain_training(monkeypatch):
    import torch.distributed as dist

    from tandem.strategies.ddp import DDPStrategy

    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    ref = __import__("copy").deepcopy(model)
    x, y = torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2])
    for attempt in range(3):  # a free port may be taken before the store binds it: try another
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            monkeypatch.setenv("MASTER_PORT", str(s.getsockname()[1]))
        try:
            strategy = DDPStrategy([CPU], sync_bn=True, timeout=30,
                                   env=read_env(Environment.read())).launch()
            break
        except RuntimeError as exc:
            if "in use" not in str(exc).lower() or attempt == 2:
                raise
    try:
        assert (strategy.rank, strategy.world_size, strategy.is_main) == (0, 1, True)
        assert strategy.backend == "gloo" and dist.is_initialized()
        wrapped = strategy.setup(model)
        out = strategy.forward_loss(wrapped, nn.CrossEntropyLoss(), x, y)
        out.loss.backward()
        ref_loss = nn.CrossEntropyLoss()(ref(x), y)
        ref_loss.backward()
        torch.testing.assert_close(out.loss.detach(), ref_loss.detach())
        for p, q in zip(strategy.unwrap(wrapped).parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
        total = strategy.all_reduce_sum(torch.tensor([1.0, 2.0]))
        assert total.tolist() == [1.0, 2.0]
        strategy.barrier()
        with strategy.no_sync(wrapped):
            pass
    finally:
        strategy.close()
    assert not dist.is_initialized()
    # The wrapper outlives close() without its reducer: the reducer did not hold the group's
    # last reference (freeing it later joins gloo's threads with the GIL held: a deadlock).
    assert "reducer" not in vars(wrapped) and "logger" not in vars(wrapped)
    strategy.close()  # twice is fine



@pytest.mark.distributed
def test_a_group_the_caller_made_is_reused_and_left_to_the_caller(tmp_path, monkeypatch):
    """A script that made its own group before handing tandem the model still has it after
    the strategy closes (its later collectives would fail otherwise)."""
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from tandem.strategies.ddp import DDPStrategy

    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():  # not dialled
        monkeypatch.setenv(key, value)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1, timeout=timedelta(seconds=60))
    try:
        from tandem.distributed import process_group

        monkeypatch.setattr(process_group, "_joined", False)
        strategy = DDPStrategy([CPU], timeout=30, env=read_env(Environment.read())).launch()
        assert strategy.backend == "gloo"
        # its gloo threads outlive it too: tandem.exit must not finalize the interpreter
        assert process_group.joined_a_group()
        strategy.close()
        assert dist.is_initialized()
        dist.barrier()  # still usable
    finally:
        dist.destroy_process_group()

_EXIT_PROBE = """
import atexit, sys
atexit.register(lambda: print("finalized", flush=True))
sys.argv = ["tandem", *sys.argv[1:]]
import runpy
runpy.run_module("tandem", run_name="__main__")
"""


@pytest.mark.distributed
@pytest.mark.parametrize("strategy, finalizes", [("ddp", False), ("single", True)])
def test_a_process_that_joined_a_group_exits_without_finalizing(strategy, finalizes, tmp_path):
    """`python -m tandem` in a torchrun worker ends with os._exit once flushed: gloo threads
    still freeing a collective's tensors when the interpreter finalizes abort the process
    (SIGABRT, 'terminate called without an active exception'). Control: a process that never
    joined a group exits normally (its atexit handler runs)."""
    import sys

    from conftest import cli_env, run_bounded

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = cli_env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                  MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # 8 synthetic 8 px images (not digits): the exit path is the same, the loading cheaper
    cmd = [sys.executable, "-c", _EXIT_PROBE, "train", "--data", "synthetic",
           "--synthetic-size", "8", "--image-size", "8", "--num-classes", "3", "--strategy",
           strategy, "--devices", "cpu", "-b", "4", "--epochs", "1", "--max-steps", "1",
           "--no-progress", "--out", str(tmp_path / "run")]
    result = run_bounded(cmd, timeout=240, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "best val acc" in result.stdout  # printed and flushed before the exit
    assert ("finalized" in result.stdout) == finalizes, result.stdout
    assert (tmp_path / "run" / "checkpoint.pt").is_file()


def test_tandem_exit_skips_finalization_only_after_joining_a_group(tmp_path):
    """``tandem.exit``: a plain process exits normally (atexit handlers run); one that joined
    a process group ends with os._exit (no finalization racing gloo's threads)."""
    import subprocess
    import sys

    script = ("import atexit, sys, tandem\n"
              "from tandem.distributed import process_group\n"
              "process_group._joined = sys.argv[1] == 'joined'\n"
              "atexit.register(lambda: print('finalized', flush=True))\n"
              "print('bye', flush=True)\n"
              "tandem.exit(3)\n")
    for joined, finalized in (("plain", True), ("joined", False)):
        proc = subprocess.run([sys.executable, "-c", script, joined], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 3, proc.stderr
        assert proc.stdout.split() == (["bye", "finalized"] if finalized else ["bye"])


# -- several machines: SLURM, the route to the master, the commands to continue, the watchdog -
def test_slurm_variables_give_the_nodes_the_master_and_a_port_from_the_job_id():
    from tandem.distributed.slurm import first_host, slurm_job

    assert first_host("gpu[07-09,12],cpu1") == "gpu07"
    assert first_host("node3,node4") == "node3"
    assert first_host("192.0.2.[1-2]") == "192.0.2.1"
    job = slurm_job({"SLURM_JOB_ID": "4242", "SLURM_NNODES": "4", "SLURM_NODEID": "2",
                     "SLURM_JOB_NODELIST": "gpu[07-10]"})
    assert (job.nnodes, job.node_rank, job.master_addr, job.master_port) == (4, 2, "gpu07", 19242)
    assert slurm_job({"SLURM_JOB_ID": "1"}) is None  # sbatch's script, not an srun task
    assert slurm_job({}) is None


def test_launch_under_srun_takes_slurm_s_variables_and_typed_flags_win(monkeypatch, capsys):
    import argparse

    from tandem.cli.launch import _from_slurm

    for key, value in {"SLURM_JOB_ID": "7", "SLURM_NNODES": "2", "SLURM_NODEID": "1",
                       "SLURM_JOB_NODELIST": "n[1-2]"}.items():
        monkeypatch.setenv(key, value)
    args = argparse.Namespace(nnodes=None, node_rank=None, master_addr=None, master_port=None,
                              rdzv_endpoint=None)
    assert _from_slurm(args) == dict(nnodes="2", node_rank=1, master_addr="n1",
                                     master_port=15007, slurm=True)
    assert "SLURM job 7: node 1 of 2, master n1:15007" in capsys.readouterr().out
    args.master_port = 29500
    assert _from_slurm(args)["master_port"] == 29500
    monkeypatch.delenv("SLURM_NODEID")
    args = argparse.Namespace(nnodes=None, node_rank=None, master_addr=None, master_port=None,
                              rdzv_endpoint=None)
    assert _from_slurm(args) == dict(nnodes="1", node_rank=0, master_addr=None,
                                     master_port=None, slurm=False)


def test_the_route_to_a_loopback_master_is_the_loopback_interface_and_a_bad_iface_is_one_line():
    from tandem.distributed.network import is_loopback, route_to

    route = route_to("127.0.0.1")  # a UDP connect: nothing is sent
    assert route.iface == "lo" and is_loopback(route.local) and is_loopback(route.remote)
    with pytest.raises(ValueError, match=r"^iface nosuch0: no such interface .* \(it has: "):
        route_to("127.0.0.1", "nosuch0")
    with pytest.raises(ValueError, match="cannot resolve the master address 'no.such.host.'"):
        route_to("no.such.host.")


def test_the_command_to_continue_names_each_node_s_flags(monkeypatch):
    from tandem.distributed.torchrun import LaunchSpec
    from tandem.distributed.resume_command import resume_command_here

    spec = LaunchSpec(nproc_per_node=2, command=["train"], nnodes="2", node_rank=1,
                      master_addr="192.0.2.1", master_port=29555, dist_timeout=20.0,
                      join_timeout=600.0)
    worker = {**ENV, "TANDEM_LAUNCH": spec.described(), "TANDEM_NODE_RANK": "1"}
    every = resume_command_here("runs/a", read_env(worker))
    assert every == "; ".join(
        f"on node {r}: tandem launch --nproc-per-node 2 --nnodes 2 --node-rank {r} "
        "--master-addr 192.0.2.1 --master-port 29555 --dist-timeout 20.0 --join-timeout 600.0 "
        "-- train --resume runs/a" for r in (0, 1))
    assert resume_command_here("runs/a", read_env(worker), this_node=True) == \
        every.split("; ")[1]
    slurm = LaunchSpec(nproc_per_node=4, command=["train"], nnodes="8", node_rank=3,
                       master_addr="gpu1", master_port=15007, slurm=True)
    worker = {**ENV, "TANDEM_LAUNCH": slurm.described()}
    assert resume_command_here("runs/a", read_env(worker)) == (
        "srun tandem launch --nproc-per-node 4 -- train --resume runs/a (on every node)")
    assert resume_command_here("runs/a", None) == "tandem train --resume runs/a"


def test_each_machine_s_copy_of_rank_0_s_checkpoint_has_a_file_of_its_own():
    """Nodes that share /tmp (several on one host) once wrote one file name, and one node's
    rename took the other's half-written copy (FileNotFoundError on 3 nodes of 4); a machine's
    other ranks read its first rank's file."""
    from tandem.distributed.env import DistEnv
    from tandem.distributed.shared_resume import _tempname

    def name(rank):  # 4 nodes of 2 workers
        return _tempname("ab" * 32, DistEnv(rank, 8, rank % 2, 2, "192.0.2.1", 29555))

    assert len({name(r) for r in (0, 2, 4, 6)}) == 4
    assert name(3) == name(2) and name(7) == name(6)
    assert name(2).endswith("tandem-resume-abababababababab-29555-2.pt")


def test_the_environment_is_read_once_into_a_frozen_copy(monkeypatch):
    """What the plan holds (its Place, and the DistEnv in it) comes from the copy: a variable
    set after the reading changes neither the copy nor what is worked out from it."""
    monkeypatch.setenv("TANDEM_SPLIT_CLOCK", "1,3")
    for key, value in {**ENV, "TANDEM_NODE_RANK": "3"}.items():
        monkeypatch.setenv(key, value)
    held = Environment.read()
    place = place_of(held)  # what the plan takes
    monkeypatch.setenv("TANDEM_NODE_RANK", "5")  # after the reading: the copy keeps 3
    monkeypatch.setenv("TANDEM_SPLIT_CLOCK", "2,2")
    assert (place.dist.node, place.split_clock) == ("3", "1,3")
    assert place_of(held).dist.node == "3" and held["TANDEM_NODE_RANK"] == "3"
    with pytest.raises(TypeError):
        held.values["TANDEM_NODE_RANK"] = "7"  # frozen
    given = Environment({**ENV, "GROUP_RANK": "1", "TANDEM_NODE_ADDR": "10.0.0.2",
                         "TORCHELASTIC_RUN_ID": "r1",
                         "TANDEM_LAUNCH": '{"nproc_per_node": 2, "nnodes": "2"}'})
    worker, place = read_env(given), place_of(given)
    assert (worker.node, worker.addr, place.run_id) == ("1", "10.0.0.2", "r1")
    assert worker.launch == {"nproc_per_node": 2, "nnodes": "2"}
    assert place_of(Environment({"TORCHELASTIC_RUN_ID": "r1"})).run_id is None  # no torchrun
    assert read_env({**ENV, "TANDEM_LAUNCH": "not json"}).launch is None