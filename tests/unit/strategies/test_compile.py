"""`--compile` against eager: same training on the same seed, and ordinary checkpoints.

torch.compile on the CPU builds C++ with the system compiler, so these tests compile for real
(small models, 8px images, few steps); nothing is timed here.
"""

import json
import shutil

import pytest
import torch
from torch import nn

from tandem import checkpoint
from tandem.cli.common import error_line
from tandem.cli.main import main
from tandem.config import ParallelConfig
from tandem.errors import UsageError
from tandem.models import create_model
from tandem.strategies import compile as compiling
from tandem.strategies import create_strategy, strategy_class
from tandem.strategies.compile import check_compile, compiling_strategies

from conftest import SUPPORT, run_in_process, run_tandem

needs_cxx = pytest.mark.skipif(not shutil.which("g++") and not shutil.which("clang++"),
                               reason="torch.compile on the CPU needs a C++ compiler")


class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.classifier = nn.Linear(4, 3)

    def forward(self, x):
        return self.classifier(self.features(x))


def _train(compiled: bool, steps: int = 3) -> tuple[nn.Module, list[float]]:
    torch.manual_seed(0)
    model = TinyNet()
    strategy = create_strategy("single", [torch.device("cpu")])
    if compiled:
        model = compiling.compiled(model)
    wrapped = strategy.setup(model)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    criterion = nn.CrossEntropyLoss()
    images = torch.randn(6, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    targets = torch.tensor([0, 1, 2, 0, 1, 2])
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        out = strategy.forward_loss(wrapped, criterion, images, targets)
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    return strategy.unwrap(wrapped), losses


@needs_cxx
def test_compiled_training_matches_eager_and_keeps_plain_keys():
    """The compiled run matches eager, and it was compiled: dynamo captured the whole forward as
    one graph (its counters, reset first), and AOTAutograd built the backward for it. A
    ``compiled`` that handed the model back unchanged would leave the counters at zero."""
    from torch._dynamo.utils import counters

    eager, eager_losses = _train(False)
    torch._dynamo.reset()
    counters.clear()
    compiled, compiled_losses = _train(True)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert counters["frames"]["ok"] == 1 and not counters["graph_break"], dict(counters)
    assert counters["aot_autograd"]["total"] >= 1, dict(counters["aot_autograd"])
    assert compiled_losses == pytest.approx(eager_losses, rel=1e-4, abs=1e-5)
    state = compiled.state_dict()
    assert not any("_orig_mod" in k for k in state)
    assert state.keys() == eager.state_dict().keys()
    for key, value in eager.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5)


@needs_cxx
# a user under --compile sees no warning of ours (dynamo warns of a functools cache it
# traces through)
@pytest.mark.filterwarnings("error:Dynamo detected a call to a `functools")
def test_compiled_keyed_dropout_draws_eagers_masks_without_recompiling():
    """Keyed dropout under --compile (tandem.keyed): each keyed layer runs eagerly between
    graphs (its key is a new integer at every step, which a graph would take for a constant),
    so the compiled model drops what eager drops, and steps after the first compile nothing
    new (dynamo's frame count stays)."""
    import copy

    from torch._dynamo.utils import counters

    from tandem.keyed import DropPath, keyed_dropout, step_stream

    torch.manual_seed(0)
    eager = keyed_dropout(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.5),
                                        nn.Linear(16, 3), DropPath(0.5)))
    model = compiling.compiled(copy.deepcopy(eager))
    torch._dynamo.reset()
    counters.clear()
    x = torch.randn(6, 8)
    frames = []
    for step in range(4):
        with step_stream(0, step, 0):
            out = model(x)
        with step_stream(0, step, 0):
            ref = eager(x)
        out.sum().backward()
        assert torch.equal(out == 0, ref == 0) and (ref == 0).any()
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        frames.append(counters["frames"]["total"])
    assert frames[0] > 0 and frames[1:] == [frames[1]] * 3, frames


def test_strategies_declare_whether_they_compile():
    assert compiling_strategies() == ["ddp", "single"]
    for name in ("dp", "balanced", "hybrid"):
        with pytest.raises(UsageError, match=f"^compile does not work with strategy {name}: "):
            check_compile(strategy_class(name))
        reason = error_line(pytest.raises(UsageError, check_compile, strategy_class(name)).value)
        assert reason.startswith(f"--compile does not work with --strategy {name}: ")
        assert "use --strategy ddp or single" in reason and "\n" not in reason


def test_compiling_checks_only_the_mode(monkeypatch):
    """Whether a run can compile is checked once, up front (``check_compile``); compiling does
    not check again (``compiled`` compiles what it is given)."""
    calls = []
    monkeypatch.setattr(compiling, "check_compile", lambda *args: calls.append(args))
    assert type(compiling.compiled(TinyNet())).__name__ == "OptimizedModule"
    assert type(compiling.compiled(TinyNet(), "max-autotune")).__name__ == "OptimizedModule"
    assert calls == []
    with pytest.raises(ValueError, match="bad compile_mode 'fast'"):
        compiling.compiled(TinyNet(), "fast")



def test_the_warm_up_leaves_no_time_for_split_auto(monkeypatch):
    """The warm-up's forward and backward (the compile itself) are recorded by ``--split
    auto`` like any step's; the warm-up must forget them, or the first real step's times would
    carry the compile. Its rehearsal is stood in for by one recorded share a device."""
    from types import SimpleNamespace

    from tandem.parallel.split import BatchSplit
    from tandem.train import run as warmup

    split = BatchSplit("auto", 2)
    trainer = SimpleNamespace(model=TinyNet(),
                              strategy=SimpleNamespace(split=split, device=torch.device("cpu")),
                              train_set=object(), val_set=object())
    rehearsed = []

    def rehearse(trainer, dataset, train):
        rehearsed.append(train)
        split.record(0, 4, 30.0)  # a compile's seconds
        split.record(1, 4, 0.1)

    monkeypatch.setattr(warmup, "_rehearse", rehearse)
    warmup.warm_up(trainer)
    assert rehearsed == [True, False]
    split.record(0, 4, 1.0)  # the first real step: both devices alike
    split.record(1, 4, 1.0)
    split.step(0, 1)
    assert split.auto.seen == 1
    assert split.auto.state_dict() == _observed_once([4, 4], [1.0, 1.0])


def _observed_once(samples, seconds) -> dict:
    from tandem.parallel.auto_split import AutoSplit

    auto = AutoSplit(2)
    auto.observe(samples, seconds)
    auto.at_epoch(0)
    return auto.state_dict()

def test_compile_flags_in_the_config():
    assert ParallelConfig(compile=True, compile_mode="max-autotune").compile_mode == "max-autotune"
    with pytest.raises(ValueError, match="compile_mode max-autotune needs compile"):
        ParallelConfig(compile_mode="max-autotune")
    with pytest.raises(ValueError, match="bad compile_mode"):
        ParallelConfig(compile=True, compile_mode="fast")


def test_compile_with_dp_is_a_one_line_error(tmp_path, capsys):
    code = main(["train", "--strategy", "dp", "--devices", "cpu:2", "--compile", "--data",
                 "synthetic", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err
    assert err == ("tandem: error: --compile does not work with --strategy dp: its replica "
                   "threads would each need their own compiled copy of the model; use "
                   "--strategy ddp or single")
    assert not (tmp_path / "run").exists()


@needs_cxx
@pytest.mark.slow
@pytest.mark.timeout(1200)  # a cold compile takes a while on a busy 2-core CPU
def test_cli_train_compile_then_load_and_eval_uncompiled(tmp_path):
    """`tandem train --compile` in a process of its own, then the checkpoint loads strictly into
    an uncompiled model and `tandem eval` scores it as the run did. The model is
    tests/support/own_model's small conv net (conv, batch norm, linear, named as a factory): the
    CLI's compile path is the same for any model, and a cold compile of a zoo resnet took
    minutes."""
    out = tmp_path / "run"
    common = ["--data", "synthetic", "--image-size", "8", "--synthetic-size", "24",
              "--num-classes", "3", "-b", "8"]
    proc = run_tandem("train", "-a", "own_model:make_net", *common, "--epochs", "1",
                      "--max-steps", "2", "--compile", "--no-progress", "--out", out,
                      timeout=900, PYTHONPATH=str(SUPPORT))  # own_model.py
    assert proc.returncode == 0, proc.stderr
    compile_lines = [l for l in proc.stdout.splitlines() if l.startswith("compiled the model")]
    assert len(compile_lines) == 1 and "not counted in step times or img/s" in compile_lines[0]
    assert json.loads((out / "config.json").read_text())["parallel"]["compile"] is True
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    assert not any("_orig_mod" in k for k in ckpt["state_dict"])
    model = create_model("own_model:make_net", num_classes=3, in_channels=3)
    checkpoint.load(out / "checkpoint.pt", model=model)  # strict, into an uncompiled model
    # The uncompiled model evaluates the checkpoint as the compiled run did (in this process:
    # eval compiles nothing, and needs no interpreter of its own).
    proc = run_in_process("eval", "--resume", out / "checkpoint.pt", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["compile_seconds"] is None and result["count"] > 0
    metrics = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert result["acc"] == pytest.approx(metrics[-1]["val_acc"], abs=1e-6)
