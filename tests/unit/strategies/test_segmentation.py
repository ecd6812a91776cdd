"""Segmentation (dense outputs, ignore_index=255): every strategy against `single` on the whole batch.

The net and data are examples/segmentation.py's. In float64, with the controls of
tests/support/exact.py: balanced over 3 CPU replicas and dp over 2 (SyncBatchNorm, uneven chunks)
give single's loss, gradients and weights after 3 steps; so do 2 ddp processes (gloo, this file is
also their worker program). Pixel accuracy and mIoU are exact against a direct computation; device 0
receives scalars and a 3x3 matrix only; output_key picks the logits of a dict or a tuple.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tandem.distributed.env import read_env
from tandem.parallel.traffic import TrafficMeter
from tandem.strategies import create_strategy
from tandem.strategies.outputs import mean_iou, pixel_accuracy
from tandem.train.metrics import Meter

# the repository (not conftest's ROOT: this file is also the workers' program, without conftest)
ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "segmentation.py"
CPU = torch.device("cpu")
TOL64 = 1e-9


def _example():
    spec = importlib.util.spec_from_file_location("segmentation_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


seg = _example()


def _criterion():
    return nn.CrossEntropyLoss(ignore_index=seg.IGNORE)


def _batches(count=3, batch=7, size=16):
    images, masks = seg.draw_shapes(count * batch, size, seed=5)
    assert (masks == seg.IGNORE).any()  # outlines are ignored
    return list(zip(images.split(batch), masks.split(batch)))


def _net(dtype):
    torch.manual_seed(0)
    return seg.make_net(num_classes=seg.NUM_CLASSES, in_channels=3).to(dtype)


def _train(strategy, dtype=torch.float64, batches=None, shard=None):
    """3 SGD(momentum) steps; returns (losses, first step's gradients, plain state)."""
    wrapped = strategy.setup(_net(dtype))
    model = strategy.unwrap(wrapped)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    criterion = _criterion()
    losses, grads = [], None
    wrapped.train()
    for x, y in batches or _batches():
        if shard is not None:
            x, y = shard(x), shard(y)
        out = strategy.forward_loss(wrapped, criterion, x.to(dtype), y)
        optimizer.zero_grad()
        out.loss.backward()
        if grads is None:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        optimizer.step()
        losses.append(out.loss.item())
    state = {k: v.detach().clone() for k, v in strategy.state_dict(wrapped).items()}
    return losses, grads, state


def _grad_diff(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_strategies_match_single_in_float64_with_controls(tmp_path):
    from exact import check_invariance

    ref_losses, ref_grads, ref_state = _train(create_strategy("single", [CPU]))
    runs = {"single32": _train(create_strategy("single", [CPU]), torch.float32),
            "balanced": _train(create_strategy("balanced", [CPU] * 3, sync_bn=True)),
            "dp": _train(create_strategy("dp", [CPU] * 2, sync_bn=True)),
            "negative": _train(create_strategy("balanced", [CPU] * 3))}  # per-chunk BN
    for name in ("balanced", "dp"):
        losses, grads, _ = runs[name]
        assert losses == pytest.approx(ref_losses, rel=0, abs=TOL64), name
        assert _grad_diff(grads, ref_grads) < TOL64, name
    assert _grad_diff(runs["negative"][1], ref_grads) > 1000 * TOL64
    paths = {}
    for name, state in [("single64", ref_state)] + [(n, r[2]) for n, r in runs.items()]:
        paths[name] = tmp_path / f"{name}.pt"
        torch.save({"state_dict": state}, paths[name])
    check_invariance(paths["single64"], {"balanced": paths["balanced"], "dp": paths["dp"]},
                     reference32=paths["single32"], negative64=paths["negative"])


def test_balanced_loss_with_ignore_index_is_the_whole_batch_loss():
    (x, y), = _batches(count=1, batch=5)
    y[:2] = seg.IGNORE  # chunk 0 (2 images of 5 over 3 devices) is entirely ignored
    model = _net(torch.float64)
    reference = _criterion()(copy.deepcopy(model)(x.double()), y)
    strategy = create_strategy("balanced", [CPU] * 3, sync_bn=True)  # whole-batch BN
    out = strategy.forward_loss(strategy.setup(model), _criterion(), x.double(), y)
    assert abs(out.loss.item() - reference.item()) < 1e-12


def _traffic_to_device0(size):
    strategy = create_strategy("balanced", [CPU] * 3, sync_bn=True)
    wrapped = strategy.setup(_net(torch.float64))
    (x, y), = _batches(count=1, batch=7, size=size)
    with TrafficMeter() as meter:
        strategy.forward_loss(wrapped, _criterion(), x.double(), y).loss.backward()
    return meter


def test_device0_receives_only_scalars_and_a_small_matrix():
    small, large = _traffic_to_device0(16), _traffic_to_device0(32)
    for meter in (small, large):
        assert meter.by_kind["gather"] == 0  # no output is gathered
        # from each of devices 1 and 2: the loss's two float64 terms (S, D) ...
        assert meter.by_kind["loss"] == 2 * 2 * 8
        # ... and one int64 vector: correct pixels and the 3x3 confusion matrix
        assert meter.by_kind["metrics"] == 2 * (1 + 3 * 3) * 8
        # the rest reaching device 0 is the parameters' gradients (data parallelism's own)
        assert meter.by_dst[0] == (meter.by_kind["loss"] + meter.by_kind["metrics"]
                                   + meter.by_kind["reduce"])
    assert small.by_dst[0] == large.by_dst[0]  # whatever the image size


def _direct_scores(logits, targets):
    """Pixel accuracy and mIoU the plain way: masks over the whole set."""
    pred, valid = logits.argmax(1), targets != seg.IGNORE
    acc = 100.0 * float((pred == targets)[valid].sum()) / float(valid.sum())
    ious = []
    for c in range(logits.shape[1]):
        inter = ((pred == c) & (targets == c) & valid).sum()
        union = (((pred == c) | (targets == c)) & valid).sum()
        if union:
            ious.append(float(inter) / float(union))
    return acc, 100.0 * sum(ious) / len(ious)


@pytest.mark.parametrize("name, replicas", [("single", 1), ("dp", 2), ("balanced", 3)])
def test_pixel_accuracy_and_miou_are_exact_over_the_set(name, replicas):
    model = _net(torch.float64).eval()
    images, masks = seg.draw_shapes(11, 16, seed=9)
    with torch.no_grad():
        acc, miou = _direct_scores(copy.deepcopy(model)(images.double()), masks)
    strategy = create_strategy(name, [CPU] * replicas)
    wrapped = strategy.setup(model).eval()
    meter = Meter()
    with torch.no_grad():
        for x, y in zip(images.split(4), masks.split(4)):  # 4, 4, 3: uneven batches
            out = strategy.forward_loss(wrapped, _criterion(), x.double(), y)
            meter.update(out.loss, out.correct, out.count, out.correct5, out.confusion)
    meter = meter.reduced(strategy)
    assert meter.dense and meter.count == 11
    assert meter.acc == pytest.approx(acc, abs=1e-12)
    assert meter.miou == pytest.approx(miou, abs=1e-12)
    assert pixel_accuracy(meter.confusion) == meter.acc and mean_iou(meter.confusion) == meter.miou


def test_miou_skips_absent_classes_and_averages_no_batches():
    confusion = torch.tensor([[5, 1, 0], [2, 2, 0], [0, 0, 0]])  # class 2 never seen
    assert mean_iou(confusion) == pytest.approx(100 * (5 / 8 + 2 / 5) / 2)
    assert pixel_accuracy(confusion) == pytest.approx(100 * 7 / 10)


class _Dict(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        logits = self.net(x)
        return {"aux": logits.mean((2, 3)), "out": logits}


class _Tuple(_Dict):
    def forward(self, x):
        out = super().forward(x)
        return out["aux"], out["out"]


@pytest.mark.parametrize("wrap, key", [(_Dict, "out"), (_Tuple, 1), (_Tuple, "1")])
@pytest.mark.parametrize("name, replicas", [("single", 1), ("dp", 2), ("balanced", 3)])
def test_output_key_picks_the_logits(wrap, key, name, replicas):
    (x, y), = _batches(count=1, batch=5)
    net = _net(torch.float64)
    reference = _criterion()(copy.deepcopy(net)(x.double()), y)
    strategy = create_strategy(name, [CPU] * replicas, sync_bn=True, output_key=key)
    out = strategy.forward_loss(strategy.setup(wrap(net)), _criterion(), x.double(), y)
    assert abs(out.loss.item() - reference.item()) < 1e-12
    assert out.confusion.shape == (3, 3) and int(out.confusion.sum()) == int((y != 255).sum())


def test_output_key_errors_say_what_there_is():
    (x, y), = _batches(count=1, batch=2)
    net = _Dict(_net(torch.float32))
    with pytest.raises(ValueError, match="returned a dict, not a tensor: pick the logits"):
        create_strategy("single", [CPU]).forward_loss(net, _criterion(), x, y)
    with pytest.raises(ValueError, match="output_key 'logits' is not in the model's output; "
                                         "its keys: 'aux', 'out'"):
        create_strategy("single", [CPU], output_key="logits").forward_loss(net, _criterion(), x, y)


def test_example_runs_and_prints_its_scores(tmp_path):
    from conftest import cli_env, run_bounded

    out = tmp_path / "seg"
    proc = run_bounded([sys.executable, EXAMPLE, "--epochs", "1", "--out", str(out)], 300,
                       cli_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = proc.stdout.strip().splitlines()[-1]
    assert final.startswith("final: val loss ") and "pixel acc" in final and "mIoU" in final
    assert float(final.split("pixel acc ")[1].split("%")[0]) > 80
    [row] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert f"mIoU {row['val_miou']:.2f}%" in final  # tandem.fit's run directory, as the CLI's


@pytest.mark.distributed
@pytest.mark.slow
def test_the_example_s_factories_under_launch_then_eval(tmp_path, monkeypatch):
    """The README's command line: the example's net and data named as factories, 2 ddp
    processes (imported again in each), then ``tandem eval`` of the run (imported again, here:
    eval needs no process of its own, only the repository root on the path as `-m tandem`
    gives it)."""
    from conftest import run_in_process, run_tandem

    out = tmp_path / "ddp"
    proc = run_tandem("launch", "--nproc-per-node", "2", "--", "train", "-a",
                      "examples.segmentation:make_net", "--data",
                      "examples.segmentation:make_data", "--strategy", "ddp", "--devices",
                      "cpu", "--sync-bn", "--ignore-index", "255", "--label-smoothing", "0",
                      "--epochs", "1", "--max-steps", "3", "--no-progress", "--out", out,
                      timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [row] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert row["step"] == 3 and 0 <= row["val_miou"] <= 100
    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(ROOT))
    ev = run_in_process("eval", "--resume", out, "--json")
    assert ev.returncode == 0, ev.stderr[-3000:]
    result = json.loads(ev.stdout)
    assert result["miou"] == pytest.approx(row["val_miou"], abs=1e-6)


# -- ddp: 2 gloo processes (this file is their worker program) --------------------------------
def worker_main(out_dir: str) -> None:
    from tandem.parallel.shares import shares
    from tandem.strategies.ddp import DDPStrategy

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    def shard(t):
        return t.split(shares(t.shape[0], [1] * world))[rank]

    with DDPStrategy([CPU], sync_bn=True, env=read_env(os.environ)) as strategy:
        losses, grads, state = _train(strategy, shard=shard)
        wrapped = strategy.setup(seg.make_net().double())
        strategy.load_state_dict(wrapped, state)
        wrapped.eval()
        images, masks = seg.draw_shapes(7, 16, seed=9)
        meter = Meter()
        with torch.no_grad():
            for x, y in zip(images.split(3), masks.split(3)):  # 3, 3, 1: rank 1 empty last
                out = strategy.forward_loss(wrapped, _criterion(), shard(x).double(), shard(y))
                meter.update(out.loss, out.correct, out.count, out.correct5, out.confusion)
        val = meter.reduced(strategy)
    torch.save({"losses": losses, "grads": grads, "state": state}, f"{out_dir}/rank{rank}.pt")
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump({"loss": val.loss, "acc": val.acc, "miou": val.miou, "count": val.count}, f)


@pytest.mark.distributed
@pytest.mark.slow
def test_ddp_matches_single(tmp_path):
    from conftest import cli_env, run_bounded

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.abspath(__file__), str(tmp_path)]
    proc = run_bounded(cmd, 240, cli_env())
    assert proc.returncode == 0, f"workers failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    ref_losses, ref_grads, ref_state = _train(create_strategy("single", [CPU]))
    model = seg.make_net().double().eval()
    model.load_state_dict(ref_state)
    images, masks = seg.draw_shapes(7, 16, seed=9)
    with torch.no_grad():
        logits = model(images.double())
    acc, miou = _direct_scores(logits, masks)
    loss = sum(_criterion()(model(x.double()), y).item() * len(y)
               for x, y in zip(images.split(3), masks.split(3))) / 7
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert got["losses"] == pytest.approx(ref_losses, rel=0, abs=TOL64)
        assert _grad_diff(got["grads"], ref_grads) < TOL64
        assert max(float((got["state"][k].double() - v.double()).abs().max())
                   for k, v in ref_state.items()) < TOL64
        val = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert val["count"] == 7
        assert val["acc"] == pytest.approx(acc, abs=1e-9)
        assert val["miou"] == pytest.approx(miou, abs=1e-9)
        assert val["loss"] == pytest.approx(loss, abs=1e-9)


if __name__ == "__main__":
    import tandem

    worker_main(sys.argv[1])
    tandem.exit(0)  # a process that joined a gloo group: no finalization racing its threads
