"""The run's plan against what it must prevent: every refusal before any process group, data
read, compile or write (spies, not clocks), and strategies that load and save model state."""

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from conftest import one_line_error, run_in_process
from tandem.config import TrainConfig
from tandem.distributed.env import Environment, read_env
from tandem.models import create_model
from tandem.strategies import Strategy, create_strategy, strategy_class, strategy_names
from tandem.train import build as build_module
from tandem.train import plan as plan_module
from tandem.train import run as run_module

CPU = torch.device("cpu")


@pytest.fixture
def spies(monkeypatch):
    """Calls of everything a refused run must not reach: data, compile, launch, writes."""
    calls = []

    def spy(name, original=None):
        def called(*args, **kwargs):
            calls.append(name)
            if original is None:
                raise AssertionError(f"{name} was reached")
            return original(*args, **kwargs)
        return called

    monkeypatch.setattr(build_module, "load_dataset", spy("load_dataset"))
    monkeypatch.setattr(torch, "compile", spy("torch.compile"))
    monkeypatch.setattr(Strategy, "launch", spy("launch", Strategy.launch))
    return calls


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A one-epoch digits run in a directory of its own."""
    out = tmp_path_factory.mktemp("plan") / "run"
    proc = run_in_process("train", "-a", "cifar_resnet20", "--data", "digits", "--epochs", "1",
                          "-b", "256", "--out", out, "--no-progress")
    assert proc.returncode == 0, proc.stderr
    return out


def test_compile_into_an_existing_run_is_refused_before_compile_or_data(finished_run, spies):
    before = sorted(os.listdir(finished_run))
    mtimes = {n: os.path.getmtime(finished_run / n) for n in before}
    proc = run_in_process("train", "-a", "cifar_resnet20", "--data", "digits", "--compile",
                          "--out", finished_run, "--no-progress")
    one_line_error(proc, "already holds a run")
    assert spies == []  # no data, no compile, no process group
    assert sorted(os.listdir(finished_run)) == before
    assert {n: os.path.getmtime(finished_run / n) for n in before} == mtimes


def test_the_same_command_into_a_new_directory_reaches_data_and_launch(tmp_path, spies):
    """The control: the spies do see a run that is not refused."""
    with pytest.raises(AssertionError, match="load_dataset was reached"):
        run_module.train(TrainConfig.from_dict(
            {"model": {"arch": "cifar_resnet20"}, "data": {"data": "digits"},
             "run": {"out": str(tmp_path / "new")}}))
    assert spies == ["launch", "load_dataset"]


@pytest.mark.parametrize("section, values, message", [
    ("parallel", {"amp": True, "amp_dtype": "fp16"}, "amp_dtype fp16 is for CUDA"),
    ("parallel", {"compile": True, "strategy": "dp", "devices": "cpu:2"},
     "compile does not work with strategy dp"),
    ("parallel", {"devices": "tpu:3"}, "bad devices 'tpu:3'"),
    ("run", {"out": "FILE"}, "is an existing file, not a directory"),
])
def test_impossible_combinations_are_refused_by_the_plan(tmp_path, spies, section, values,
                                                          message):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    values = {k: (str(a_file) if v == "FILE" else v) for k, v in values.items()}
    raw = {"model": {"arch": "cifar_resnet20"}, "data": {"data": "digits"},
           "run": {"out": str(tmp_path / "out")}}
    raw.setdefault(section, {}).update(values)
    with pytest.raises(ValueError, match=message):
        plan_module.plan_train(TrainConfig.from_dict(raw))
    assert spies == [] and not (tmp_path / "out").exists()


def test_a_ddp_strategy_joins_nothing_until_launched(tmp_path):
    """Built from torchrun's environment, it has its rank and device; only launch() joins,
    so a plan refused after building it leaves no process group behind."""
    env = Environment({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                       "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
                       "TORCHELASTIC_RUN_ID": "x"})
    strategy = create_strategy("ddp", [CPU], env=read_env(env))
    assert (strategy.rank, strategy.world_size, strategy.device) == (0, 1, CPU)
    assert not dist.is_initialized() and strategy.backend is None
    strategy.close()  # nothing joined: nothing to leave, no error
    existing = tmp_path / "run"
    existing.mkdir()
    (existing / "metrics.jsonl").write_text('{"epoch": 1, "val_acc": 50.0}\n')
    with pytest.raises(ValueError, match="already holds a run"):
        plan_module.plan_train(TrainConfig.from_dict(
            {"model": {"arch": "cifar_resnet20"}, "data": {"data": "digits"},
             "parallel": {"strategy": "ddp", "devices": "cpu"}, "run": {"out": str(existing)}}),
            environ=env)
    assert not dist.is_initialized()


def test_plan_modes_fresh_resumed_forked(finished_run, tmp_path):
    base = {"model": {"arch": "cifar_resnet20"}, "data": {"data": "digits"}}
    fresh = plan_module.plan_train(TrainConfig.from_dict({**base, "run": {
        "out": str(tmp_path / "x")}}))
    assert fresh.mode == plan_module.FRESH and fresh.checkpoint is None
    resumed = plan_module.plan_train(
        TrainConfig.from_dict({"run": {"resume": str(finished_run)},
                               "optim": {"epochs": 2}}), frozenset({"resume", "epochs"}))
    assert resumed.mode == plan_module.RESUMED and resumed.run_dir.same(resumed.source)
    forked = plan_module.plan_train(
        TrainConfig.from_dict({"run": {"resume": str(finished_run), "out": str(tmp_path / "f")},
                               "optim": {"epochs": 2}}), frozenset({"resume", "epochs", "out"}))
    assert forked.mode == plan_module.FORKED and not forked.run_dir.same(forked.source)
    assert not (tmp_path / "f").exists()  # a plan writes nothing
    complete = plan_module.plan_train(TrainConfig.from_dict({"run": {"resume": str(
        finished_run)}}), frozenset({"resume"}))
    assert isinstance(complete, str) and "is complete" in complete


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(64, 5))


@pytest.mark.parametrize("name", strategy_names(multiprocess=False))
def test_every_strategy_loads_and_saves_plain_state_both_ways(name):
    cls = strategy_class(name)
    model = create_model("alexnet", num_classes=5) if cls.check_model(_model()) else _model()
    other = create_model("alexnet", num_classes=5) if cls.check_model(_model()) else _model()
    with torch.no_grad():
        for t in other.state_dict().values():
            if t.is_floating_point():
                t.add_(torch.randn_like(t))
    devices = [CPU] if cls.max_devices == 1 else [CPU, CPU]
    with create_strategy(name, devices) as strategy:
        wrapped = strategy.setup(model)
        strategy.load_state_dict(wrapped, other.state_dict())
        got = strategy.state_dict(wrapped)
        assert list(got) == list(other.state_dict())
        assert all(torch.equal(got[k], v) for k, v in other.state_dict().items())
        assert all(torch.equal(a, b) for a, b in zip(strategy.unwrap(wrapped).state_dict().values(),
                                                      other.state_dict().values())) or \
            name == "hybrid"  # its classifier is sharded: compared through state_dict above
        bad = dict(other.state_dict())
        key = next(k for k, v in bad.items() if v.dim() > 1)
        bad[key] = bad[key][:1]
        with pytest.raises(ValueError, match=f"1 shape mismatch \\({key}"):
            strategy.load_state_dict(wrapped, bad)
        del bad[key]
        with pytest.raises(ValueError, match=f"1 missing key \\(e.g. {key}\\)"):
            strategy.load_state_dict(wrapped, bad)


def test_eval_of_a_run_directory_evaluates_its_latest_checkpoint(finished_run):
    by_dir = run_in_process("eval", "--resume", finished_run, "--json")
    by_file = run_in_process("eval", "--resume", finished_run / "checkpoint.pt", "--json")
    assert by_dir.returncode == 0 and by_file.returncode == 0, by_dir.stderr
    dir_result, file_result = (__import__("json").loads(p.stdout) for p in (by_dir, by_file))
    assert dir_result["loss"] == file_result["loss"] and dir_result["count"] > 0


def test_resume_eval_and_pretrained_load_weights_through_the_strategy(finished_run, tmp_path,
                                                                     monkeypatch):
    """The strategy owns model state both ways: every way in goes through its
    load_state_dict, after its setup (the model it loads into is the set-up one)."""
    loads = []
    original = Strategy.load_state_dict

    def spy(self, wrapped, state):
        loads.append((self.name, type(wrapped).__name__))
        return original(self, wrapped, state)

    monkeypatch.setattr(Strategy, "load_state_dict", spy)
    assert run_in_process("eval", "--resume", finished_run).returncode == 0
    proc = run_in_process("train", "-a", "cifar_resnet20", "--data", "digits", "--strategy", "dp",
                          "--devices", "cpu:2", "--pretrained", finished_run / "best.pt",
                          "--max-steps", "1", "--out", tmp_path / "p", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    proc = run_in_process("train", "--resume", finished_run, "--epochs", "2", "--max-steps",
                          str(1 + _steps(finished_run)), "--out", tmp_path / "f", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert loads == [("single", "ResNet"), ("dp", "DataParallel"),
                     ("single", "ResNet")]


def _steps(run) -> int:
    return int(torch.load(run / "checkpoint.pt")["data_position"]["step"])
