# Compares hybrid's checkpointed optimizer state with single's (float64) and with its own (bits).
"""A hybrid run saves its classifier's optimizer state in the plain model's layout: it goes on
under another strategy, another strategy's run goes on under hybrid, each as the straight run
(float64, with a noise-floor and a negative control), and hybrid's own resume keeps its bits.
A checkpoint of the older per-shard layout still loads under hybrid."""

import torch

from conftest import ok
from exact import check_invariance, same_bits
from tandem.hybrid import HybridParallel
from tandem.strategies import create_strategy

# AlexNet's layout with a 256-wide classifier (hybrid splits it all the same), no dropout;
# 3 steps an epoch: --max-steps 3 stops at the end of epoch 1 of 2
ARGS = ["--data", "synthetic", "--synthetic-size", "24", "--image-size", "64",
        "--num-classes", "10", "-a", "small_alexnet:make", "-b", "8", "--epochs", "2",
        "--no-progress", "--seed", "5", "--lr-schedule", "constant"]
SINGLE = ["--strategy", "single", "--devices", "cpu"]
HYBRID = ["--strategy", "hybrid", "--devices", "cpu:2"]


def train(out, *args):
    return ok("train", *ARGS, *args, "--out", out)


def resume(out, *args):
    return ok("train", "--resume", out, *args)


def test_hybrid_and_single_continue_each_others_runs(tmp_path):
    f64 = ("--dtype", "float64")
    train(tmp_path / "ref64", *SINGLE, *f64)
    train(tmp_path / "ref32", *SINGLE)
    train(tmp_path / "h2s", *HYBRID, *f64, "--max-steps", "3")
    resume(tmp_path / "h2s", *SINGLE)
    train(tmp_path / "s2h", *SINGLE, *f64, "--max-steps", "3")
    resume(tmp_path / "s2h", *HYBRID)
    # negative control: the same resume without the momentum it saved
    train(tmp_path / "lost", *HYBRID, *f64, "--max-steps", "3")
    ckpt = torch.load(tmp_path / "lost" / "checkpoint.pt", weights_only=True)
    ckpt["optimizer"]["state"] = {}
    torch.save(ckpt, tmp_path / "lost" / "checkpoint.pt")
    resume(tmp_path / "lost", *SINGLE)
    check_invariance(tmp_path / "ref64" / "checkpoint.pt",
                     {name: tmp_path / name / "checkpoint.pt" for name in ("h2s", "s2h")},
                     reference32=tmp_path / "ref32" / "checkpoint.pt",
                     negative64=tmp_path / "lost" / "checkpoint.pt")


def test_hybrids_own_resume_keeps_its_bits(tmp_path):
    train(tmp_path / "straight", *HYBRID)
    train(tmp_path / "stopped", *HYBRID, "--max-steps", "3")
    resume(tmp_path / "stopped")
    a, b = (torch.load(tmp_path / d / "checkpoint.pt", weights_only=True)
            for d in ("straight", "stopped"))
    assert same_bits(a["state_dict"], b["state_dict"]) == []
    assert same_bits(a["optimizer"]["state"], b["optimizer"]["state"]) == []


def _stepped_hybrid():
    from small_alexnet import make

    torch.manual_seed(0)
    strategy = create_strategy("hybrid", [torch.device("cpu")] * 3)
    wrapped = strategy.setup(make(10, 3))
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    wrapped(torch.randn(4, 3, 64, 64)).logsumexp(1).sum().backward()
    optimizer.step()
    return strategy, wrapped, optimizer


def test_plain_layout_is_the_plain_models_and_the_older_per_shard_layout_still_loads():
    strategy, wrapped, optimizer = _stepped_hybrid()
    assert isinstance(wrapped, HybridParallel)
    plain = strategy.optimizer_state_dict(wrapped, optimizer)
    model = wrapped.to_model()
    shapes = [tuple(p.shape) for p in model.parameters()]
    assert [tuple(plain["state"][k]["momentum_buffer"].shape) for k in range(len(shapes))] == \
        shapes
    assert plain["param_groups"][0]["params"] == list(range(len(shapes)))
    assert len(optimizer.state_dict()["state"]) > len(shapes)  # split: more shard params
    for saved in (plain, optimizer.state_dict()):  # the plain layout, and the older one
        _, again, fresh = _stepped_hybrid()
        for state in fresh.state.values():
            state["momentum_buffer"].zero_()
        strategy.load_optimizer_state_dict(again, fresh, saved)
        assert same_bits(fresh.state_dict(), optimizer.state_dict()) == []
