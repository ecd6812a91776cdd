"""tandem.checkpoint: unwrapped saves, atomic writes, safe loads and one-line errors."""

import argparse
import os
import pickle
import random
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from tandem import checkpoint, model_state
from tandem.checkpoint import CheckpointError
from tandem.distributed.process_group import release_ddp


def make_model(in_ch=1):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(in_ch, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3),
    )


def train_steps(model, optimizer, steps, seed=1, in_ch=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(6, in_ch, 5, 5, generator=g)
        y = torch.randint(3, (6,), generator=g)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)


def assert_same_state(a: nn.Module, b: nn.Module):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:  # on the CPU: torch's DataParallel moves modules to cuda:0 where it can
        assert torch.equal(sa[k].cpu(), sb[k].cpu()), k


def one_line(exc_info, path):
    msg = str(exc_info.value)
    assert "\n" not in msg and str(path) in msg
    return msg


# -- round trips -----------------------------------------------------------------------------

def test_round_trip_restores_model_buffers_optimizer_and_extras(tmp_path):
    model = make_model()
    opt = sgd(model)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2, 5])
    train_steps(model, opt, 3)
    sched.step()
    assert model[1].num_batches_tracked.item() == 3  # buffers are not at their defaults
    path = checkpoint.save(tmp_path / "c.pt", model, opt, epoch=4, arch="tiny", best_acc1=55.5,
                           scheduler=sched, config={"lr": 0.1, "devices": ["cpu", "cpu"]},
                           data_position={"epoch": 4, "batch": 7}, note="hello")
    fresh = make_model()
    torch.nn.init.zeros_(fresh[0].weight)
    fresh_opt = sgd(fresh)
    fresh_sched = torch.optim.lr_scheduler.MultiStepLR(fresh_opt, milestones=[9])
    ckpt = checkpoint.load(path, fresh, fresh_opt)
    assert_same_state(model, fresh)
    assert (ckpt["epoch"], ckpt["arch"], ckpt["best_acc1"]) == (4, "tiny", 55.5)
    assert ckpt["data_position"] == {"epoch": 4, "batch": 7} and ckpt["note"] == "hello"
    assert ckpt["config"] == {"lr": 0.1, "devices": ["cpu", "cpu"]}
    assert ckpt["format"] == checkpoint.FORMAT and ckpt["tandem_version"]
    fresh_sched.load_state_dict(ckpt["scheduler"])
    assert fresh_sched.state_dict() == sched.state_dict()
    for pa, pb in zip(opt.state.values(), fresh_opt.state.values()):
        assert torch.equal(pa["momentum_buffer"], pb["momentum_buffer"])


def test_resume_continues_exactly(tmp_path):
    straight = make_model()
    opt = sgd(straight)
    train_steps(straight, opt, 2, seed=1)
    train_steps(straight, opt, 2, seed=2)

    first = make_model()
    opt1 = sgd(first)
    train_steps(first, opt1, 2, seed=1)
    checkpoint.save(tmp_path / "c.pt", first, opt1)
    resumed = make_model()
    opt2 = sgd(resumed)
    checkpoint.load(tmp_path / "c.pt", resumed, opt2)
    train_steps(resumed, opt2, 2, seed=2)
    assert_same_state(straight, resumed)


def test_everything_saved_loads_with_plain_weights_only(tmp_path):
    @dataclass
    class Config:
        data: Path
        lr: float

    model = make_model()
    path = checkpoint.save(
        tmp_path / "c.pt", model, sgd(model), config=Config(Path("/data/x"), np.float32(0.5)),
        args=argparse.Namespace(a=1, b=[np.int64(3)]), table=np.arange(3), flags={1, 2})
    raw = torch.load(path, weights_only=True)  # no allow-listing needed
    assert raw["config"] == {"data": "/data/x", "lr": 0.5}
    assert raw["args"] == {"a": 1, "b": [3]} and raw["flags"] == {1, 2}
    assert torch.equal(raw["table"], torch.arange(3))
    assert {"torch", "numpy", "python"} <= set(raw["rng"])


def test_unstorable_values_are_refused_by_name(tmp_path):
    model = make_model()
    with pytest.raises(TypeError, match=r"config\['fn'\]"):
        checkpoint.save(tmp_path / "c.pt", model, config={"fn": lambda x: x})
    with pytest.raises(TypeError, match="reserved"):
        checkpoint.save(tmp_path / "c.pt", model, state_dict={})
    assert not (tmp_path / "c.pt").exists()


# -- wrappers --------------------------------------------------------------------------------

def test_torch_dataparallel_saved_without_prefix_and_loaded_into_wrapped(tmp_path):
    model = make_model()
    wrapped = nn.DataParallel(nn.DataParallel(model))  # CPU: no devices, it only wraps
    assert model_state.unwrap(wrapped) is model
    assert list(checkpoint.plain_state_dict(wrapped)) == list(model.state_dict())
    checkpoint.save(tmp_path / "c.pt", wrapped)
    raw = torch.load(tmp_path / "c.pt", weights_only=True)
    assert not any(k.startswith("module.") for k in raw["state_dict"])
    assert "1.running_mean" in raw["state_dict"]
    target = nn.DataParallel(make_model())
    nn.init.ones_(target.module[5].weight)
    checkpoint.load(tmp_path / "c.pt", target)
    assert_same_state(model, target.module)


@pytest.mark.parametrize("style", ["bare", "imagenet"])
def test_module_prefixed_torch_checkpoints_load(tmp_path, style):
    model = make_model()
    opt = sgd(model)
    train_steps(model, opt, 1)
    dp_state = nn.DataParallel(model).state_dict()  # (on a 1-GPU machine this is on cuda:0)
    assert all(k.startswith("module.") for k in dp_state)
    if style == "bare":
        obj = dp_state
    else:  # what the imagenet example writes
        obj = {"epoch": 3, "arch": "tiny", "state_dict": dp_state, "best_acc1": torch.tensor(9.0),
               "optimizer": opt.state_dict(), "scheduler": None}
    torch.save(obj, tmp_path / "dp.pt")
    fresh = make_model()
    nn.init.zeros_(fresh[0].weight)
    fresh_opt = sgd(fresh)
    ckpt = checkpoint.load(tmp_path / "dp.pt", fresh, fresh_opt)
    assert_same_state(model, fresh)
    assert list(ckpt["state_dict"]) == list(model.state_dict())
    if style == "imagenet":
        assert ckpt["epoch"] == 3 and len(fresh_opt.state) == len(opt.state)
    else:
        assert len(fresh_opt.state) == 0  # nothing to restore: left untouched


def test_prefix_kept_when_only_some_keys_have_it(tmp_path):
    # e.g. a model with a real child called "module" next to another child
    state = {"module.weight": torch.ones(2, 2), "head.weight": torch.ones(1, 2)}
    torch.save(state, tmp_path / "odd.pt")
    assert set(checkpoint.load(tmp_path / "odd.pt")["state_dict"]) == set(state)


class FakeHybrid(nn.Module):
    """Stores the model's last Linear split in two halves, like HybridParallel does."""

    def __init__(self, model):
        super().__init__()
        self.trunk = model[:5]
        w, b = model[5].weight.detach(), model[5].bias.detach()
        self.top = nn.Linear(4, 2)
        self.bottom = nn.Linear(4, 1)
        self.load_plain_state_dict(
            {**{f"{k}": v for k, v in model.state_dict().items()}, "5.weight": w, "5.bias": b})

    def plain_state_dict(self):
        sd = OrderedDict(self.trunk.state_dict())
        sd["5.weight"] = torch.cat([self.top.weight, self.bottom.weight]).detach()
        sd["5.bias"] = torch.cat([self.top.bias, self.bottom.bias]).detach()
        return sd

    def load_plain_state_dict(self, sd):
        self.trunk.load_state_dict({k: v for k, v in sd.items() if not k.startswith("5.")})
        with torch.no_grad():
            self.top.weight.copy_(sd["5.weight"][:2]); self.top.bias.copy_(sd["5.bias"][:2])
            self.bottom.weight.copy_(sd["5.weight"][2:]); self.bottom.bias.copy_(sd["5.bias"][2:])


def test_split_wrappers_are_merged_and_split_through_their_hooks(tmp_path):
    model = make_model()
    train_steps(model, sgd(model), 1)
    hybrid = nn.DataParallel(FakeHybrid(make_model()))  # a wrapper around the split model
    checkpoint.load(_save_plain(tmp_path, model), hybrid)
    assert torch.equal(hybrid.module.bottom.weight.cpu(), model[5].weight[2:])
    path = checkpoint.save(tmp_path / "h.pt", hybrid)
    plain = make_model()
    nn.init.zeros_(plain[5].weight)
    checkpoint.load(path, plain)
    assert_same_state(model, plain)
    with pytest.raises(CheckpointError, match="1 shape mismatch"):
        checkpoint.load(_save_plain(tmp_path, make_model(in_ch=2)), FakeHybrid(make_model()))


def _save_plain(tmp_path, model):
    return checkpoint.save(tmp_path / "plain.pt", model, rng=False)


@pytest.mark.distributed
def test_distributed_data_parallel_is_unwrapped(tmp_path):
    from datetime import timedelta

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1, timeout=timedelta(seconds=60))
    wrappers = []
    try:
        model = make_model()
        ddp = nn.parallel.DistributedDataParallel(model)
        wrappers.append(ddp)
        train_steps(ddp, sgd(ddp), 1)
        checkpoint.save(tmp_path / "ddp.pt", ddp)
        fresh = make_model()
        nn.init.zeros_(fresh[0].weight)
        fresh_ddp = nn.parallel.DistributedDataParallel(fresh)
        wrappers.append(fresh_ddp)
        checkpoint.load(tmp_path / "ddp.pt", fresh_ddp)
        assert_same_state(model, fresh)
    finally:
        for wrapped in wrappers:
            release_ddp(wrapped)  # before the group goes (see release_ddp)
        dist.destroy_process_group()
    assert not any(k.startswith("module.")
                   for k in torch.load(tmp_path / "ddp.pt", weights_only=True)["state_dict"])


# -- atomic writes ---------------------------------------------------------------------------

def test_interrupted_save_leaves_previous_checkpoint_intact(tmp_path, monkeypatch):
    model = make_model()
    path = checkpoint.save(tmp_path / "c.pt", model, epoch=1)
    before = path.read_bytes()
    real_save = torch.save

    def dying_save(obj, f, *a, **kw):
        real_save(obj, f, *a, **kw)  # write it all...
        f.seek(0)
        f.truncate(100)  # ...then lose most of it and die, as a crash mid-write would
        raise OSError("disk on fire")

    monkeypatch.setattr(torch, "save", dying_save)
    nn.init.zeros_(model[0].weight)
    with pytest.raises(OSError, match="disk on fire"):
        checkpoint.save(path, model, epoch=2)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert checkpoint.load(path)["epoch"] == 1
    assert os.listdir(tmp_path) == ["c.pt"]  # the temporary file is gone


def test_save_creates_parent_dirs_and_replaces(tmp_path):
    model = make_model()
    path = checkpoint.save(tmp_path / "run" / "deep" / "c.pt", model, epoch=1)
    checkpoint.save(path, model, epoch=2)
    assert checkpoint.load(path)["epoch"] == 2
    assert os.listdir(path.parent) == ["c.pt"]


# -- refusing bad files ----------------------------------------------------------------------

class Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("writer", ["pickle2", "pickle4", "torch.save"])
def test_malicious_pickle_is_refused_and_never_runs(tmp_path, writer):
    marker = tmp_path / "PWNED"
    path = tmp_path / "evil.pt"
    payload = {"state_dict": {}, "epoch": Evil(marker)}
    if writer.startswith("pickle"):
        with open(path, "wb") as f:
            pickle.dump(payload, f, protocol=int(writer[-1]))
    else:
        torch.save(payload, path)
    # protocol 4 trips the safe loader on its framing opcode before it reaches the payload,
    # which reads as an unreadable file; the others name the blocked global
    match = "corrupt or unreadable" if writer == "pickle4" else "refused.*posix.system"
    with pytest.raises(CheckpointError, match=match) as info:
        checkpoint.load(path, make_model())
    one_line(info, path)
    assert not marker.exists()


def test_corrupt_missing_and_foreign_files(tmp_path):
    model = make_model()
    good = checkpoint.save(tmp_path / "good.pt", model).read_bytes()
    cases = {
        "truncated.pt": (good[: len(good) // 2], "corrupt or unreadable"),
        "garbage.pt": (b"\x00\x01definitely not a checkpoint" * 20, "corrupt or unreadable"),
        "empty.pt": (b"", r"is empty \(0 bytes\)"),
    }
    for name, (data, expected) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(CheckpointError, match=expected) as info:
            checkpoint.load(tmp_path / name, model)
        one_line(info, tmp_path / name)
    with pytest.raises(CheckpointError, match="does not exist") as info:
        checkpoint.load(tmp_path / "missing.pt", model)
    one_line(info, tmp_path / "missing.pt")
    torch.save([1, 2, 3], tmp_path / "list.pt")
    with pytest.raises(CheckpointError, match="holds a list") as info:
        checkpoint.load(tmp_path / "list.pt")
    one_line(info, tmp_path / "list.pt")
    torch.save({"epoch": 3, "lr": 0.1}, tmp_path / "dict.pt")
    with pytest.raises(CheckpointError, match="not a checkpoint.*keys: epoch, lr"):
        checkpoint.load(tmp_path / "dict.pt")
    with pytest.raises(CheckpointError, match="is a directory"):
        checkpoint.load(tmp_path, model)  # a directory
    assert issubclass(CheckpointError, ValueError)


def test_wrong_architecture_is_summarised(tmp_path):
    path = checkpoint.save(tmp_path / "c.pt", make_model())
    other = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(),
                          nn.Linear(4, 3))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointError) as info:
        checkpoint.load(path, other)
    msg = one_line(info, path)
    assert msg == (f"checkpoint '{path}' does not fit the model: 2 missing keys (e.g. "
                   f"6.weight), 2 unexpected keys (e.g. 5.weight), 1 shape mismatch "
                   f"(0.weight: checkpoint [4,1,3,3] vs model [4,2,3,3])")
    # nothing was loaded, not even the keys that did fit
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())


def test_optimizer_that_does_not_fit(tmp_path):
    model = make_model()
    opt = sgd(model)
    train_steps(model, opt, 1)
    path = checkpoint.save(tmp_path / "c.pt", model, opt)
    fresh = make_model()
    wrong = torch.optim.SGD([fresh[0].weight], lr=0.1)
    with pytest.raises(CheckpointError, match="optimizer state does not fit") as info:
        checkpoint.load(path, fresh, wrong)
    one_line(info, path)


# -- RNG -------------------------------------------------------------------------------------

def draws():
    return (torch.rand(3).tolist(), np.random.rand(3).tolist(), np.random.randn(1).tolist(),
            [random.random() for _ in range(3)], random.gauss(0, 1))


def test_capture_and_restore_rng_round_trip(tmp_path):
    torch.manual_seed(5); np.random.seed(5); random.seed(5)
    np.random.randn(1); random.gauss(0, 1)  # leave cached gaussians in both generators
    state = checkpoint.capture_rng()
    expected = draws()
    checkpoint.restore_rng(state)
    assert draws() == expected
    # through a checkpoint file, with other draws in between
    model = make_model()  # (reseeds torch: build it before restoring)
    checkpoint.restore_rng(state)
    path = checkpoint.save(tmp_path / "c.pt", model)
    draws()
    checkpoint.restore_rng(checkpoint.load(path)["rng"])
    assert draws() == expected
    assert "rng" not in checkpoint.load(checkpoint.save(tmp_path / "n.pt", make_model(),
                                                        rng=False))
    with pytest.raises(ValueError):
        checkpoint.restore_rng([1, 2])


class _FakeCuda:
    """Two GPUs' generators, as ``torch.cuda`` shows them to one process (on the CPU)."""

    def __init__(self, current: int):
        self.current, self.states = current, {0: "fresh", 1: "fresh"}

    def install(self, monkeypatch):
        for name, value in {"is_available": lambda: True, "is_initialized": lambda: True,
                            "device_count": lambda: 2, "current_device": lambda: self.current,
                            "get_rng_state_all": lambda: [self.states[0], self.states[1]],
                            "set_rng_state": lambda s, i: self.states.__setitem__(i, s)}.items():
            monkeypatch.setattr(torch.cuda, name, value)


def test_a_ddp_rank_resumes_its_own_gpus_generator_from_rank_0s(monkeypatch):
    """ddp rank 1 runs on cuda:1; rank 0, which saves, on cuda:0. Every rank is seeded alike,
    so rank 0's cuda:0 generator is where rank 1's cuda:1 one was; rank 0's cuda:1 was never
    used. On resume rank 1's cuda:1 takes the state of cuda:0 (dropout masks go on, not over
    again from the seed)."""
    rank0 = _FakeCuda(current=0)
    rank0.states[0] = "after 40 steps"
    rank0.install(monkeypatch)
    saved = checkpoint.capture_rng()
    rank1 = _FakeCuda(current=1)
    rank1.install(monkeypatch)
    checkpoint.restore_rng(saved)
    assert rank1.states[1] == "after 40 steps"
    resumed0 = _FakeCuda(current=0)  # rank 0, and a one-process run: its own state back
    resumed0.install(monkeypatch)
    checkpoint.restore_rng(saved)
    assert resumed0.states == {0: "after 40 steps", 1: "fresh"}



def test_a_run_on_the_second_gpu_resumes_under_ranks_that_include_it(monkeypatch):
    """`--strategy single --devices cuda:1` never makes cuda:1 the current device (0 stays
    current): the saver's own generator is the one of the device it trained on, cuda:1. Its
    state goes to the resuming rank's own device, here cuda:1 again; the process's current
    device would have named cuda:0's unused one and thrown cuda:1's away."""
    single = _FakeCuda(current=0)
    single.states[1] = "after 40 steps on cuda:1"
    single.install(monkeypatch)
    saved = checkpoint.capture_rng(torch.device("cuda:1"))
    rank = _FakeCuda(current=1)  # a ddp rank on cuda:1 (set_device made it current)
    rank.install(monkeypatch)
    checkpoint.restore_rng(saved, torch.device("cuda:1"))
    assert rank.states[1] == "after 40 steps on cuda:1"
    alone = _FakeCuda(current=0)  # the same single run resumed: cuda:0 is current again
    alone.install(monkeypatch)
    checkpoint.restore_rng(saved, torch.device("cuda:1"))
    assert alone.states == {0: "fresh", 1: "after 40 steps on cuda:1"}

# -- tandem's own wrappers ------------------------------------------------------------------

@pytest.mark.parametrize("wrapper", ["DataParallel", "DataParallelModel"])
def test_tandem_data_parallel_is_unwrapped(tmp_path, wrapper):
    import tandem.parallel as tp

    model = make_model()
    wrapped = getattr(tp, wrapper)(model, ["cpu"] * 3)
    assert model_state.unwrap(wrapped) is model
    opt = sgd(wrapped)
    g = torch.Generator().manual_seed(3)
    out = wrapped(torch.randn(5, 1, 5, 5, generator=g))
    logits = torch.cat(out) if isinstance(out, (list, tuple)) else out
    nn.functional.cross_entropy(logits, torch.randint(3, (5,), generator=g)).backward()
    opt.step()
    path = checkpoint.save(tmp_path / "c.pt", wrapped, opt)
    assert list(torch.load(path, weights_only=True)["state_dict"]) == list(model.state_dict())
    fresh = make_model()
    nn.init.zeros_(fresh[0].weight)
    checkpoint.load(path, getattr(tp, wrapper)(fresh, ["cpu"] * 2), sgd(fresh))
    assert_same_state(model, fresh)


class FeaturesClassifier(nn.Module):
    def __init__(self, in_ch=1):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(in_ch, 4, 3, padding=1), nn.BatchNorm2d(4),
                                      nn.ReLU())
        self.avgpool = nn.AdaptiveAvgPool2d(2)
        self.classifier = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3))

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def test_hybrid_parallel_saves_merged_and_loads_plain(tmp_path):
    from tandem.hybrid import HybridParallel

    torch.manual_seed(0)
    hybrid = HybridParallel(FeaturesClassifier(), ["cpu"] * 3)
    opt = sgd(hybrid)
    x, y = torch.randn(5, 1, 6, 6), torch.tensor([0, 1, 2, 0, 1])
    nn.functional.cross_entropy(hybrid(x), y).backward()
    opt.step()
    merged = {k: v.clone() for k, v in hybrid.plain_state_dict().items()}
    assert merged["features.1.num_batches_tracked"].item() == 1  # trained, buffers included
    path = checkpoint.save(tmp_path / "h.pt", hybrid)
    plain = FeaturesClassifier()
    checkpoint.load(path, plain)
    assert list(plain.state_dict()) == list(merged)
    for k, v in plain.state_dict().items():
        assert torch.equal(v, merged[k]), k
    other = HybridParallel(FeaturesClassifier(), ["cpu"] * 2)
    checkpoint.load(path, other)  # a plain checkpoint split over a different device count
    other.eval(), plain.eval()
    assert torch.allclose(other(x), plain(x), atol=1e-6)
    with pytest.raises(CheckpointError, match="shape mismatch.*features.0.weight"):
        checkpoint.load(path, HybridParallel(FeaturesClassifier(in_ch=2), ["cpu"] * 2))


# -- CUDA ------------------------------------------------------------------------------------

@pytest.mark.cuda
def test_cuda_model_and_rng_round_trip(tmp_path):
    model = make_model().cuda()
    opt = sgd(model)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 1, 5, 5, generator=g).cuda(), torch.randint(3, (6,), generator=g).cuda()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    torch.cuda.manual_seed_all(7)
    torch.rand(3, device="cuda")
    path = checkpoint.save(tmp_path / "c.pt", nn.DataParallel(model), opt)
    expected = torch.rand(5, device="cuda").tolist()
    ckpt = torch.load(path, weights_only=True, map_location="cpu")
    assert ckpt["state_dict"]["0.weight"].device.type == "cpu"
    assert len(ckpt["rng"]["cuda"]) == torch.cuda.device_count()
    checkpoint.restore_rng(ckpt["rng"])
    assert torch.rand(5, device="cuda").tolist() == expected
    plain = make_model()  # CPU model from a CUDA checkpoint
    checkpoint.load(path, plain)
    assert all(torch.equal(v.cpu(), plain.state_dict()[k]) for k, v in model.state_dict().items())
    fresh = make_model().cuda()
    fresh_opt = sgd(fresh)
    checkpoint.load(path, fresh, fresh_opt, map_location="cuda")
    state = next(iter(fresh_opt.state.values()))
    assert state["momentum_buffer"].device.type == "cuda"


def test_directory_and_empty_file_get_plain_reasons(tmp_path):
    from tandem import checkpoint as ckpt_mod

    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(ckpt_mod.CheckpointError, match=r"is a directory$"):
        ckpt_mod.load(run)
    ckpt_mod.save(run / "checkpoint.pt", torch.nn.Linear(2, 2))
    with pytest.raises(ckpt_mod.CheckpointError, match=r"is a directory \(it holds checkpoint\.pt\)$"):
        ckpt_mod.load(run)
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    with pytest.raises(ckpt_mod.CheckpointError, match=r"'.*empty\.pt' is empty \(0 bytes\)"):
        ckpt_mod.load(empty)
