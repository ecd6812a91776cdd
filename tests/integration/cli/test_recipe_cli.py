"""The recipe's flags from the command line and tandem.fit against what they promise: one-line
errors naming the flag (the parameter through tandem.fit); --lr-scale's lr said and recorded;
the defaults the imagenet example's (SGD, one group, no scaling), and its file resumed under
another optimizer saying so; --model-ema's validation in the epoch line and metrics.jsonl,
best.pt by its score, `tandem eval --ema` giving the same figures; fp16's grad scaler unscaled
before the clip (the loop's step against the same step unscaled)."""

import json

import pytest
import torch
from conftest import ok, one_line_error, run_in_process
from recipe_net import make
from strategy_steps import Tiny

import tandem
from tandem.config import OptimConfig, RunConfig, TrainConfig
from tandem.errors import UsageError
from tandem.strategies import create_strategy
from tandem.train.loop import Trainer
from tandem.train.recipe import make_clip, make_optimizer
from tandem.train.schedule import make_scheduler

TINY = ["--data", "digits", "-a", "recipe_net:make", "-b", "16", "--no-progress", "--seed", "1",
        "--strategy", "single", "--devices", "cpu"]


@pytest.mark.parametrize("flags,words", [
    (["--opt", "adam"], ["bad --opt 'adam'", "sgd, adamw, lars, lamb", "adamw?"]),
    (["--model-ema", "1.5"], ["bad --model-ema 1.5", "(0, 1)"]),
    (["--clip-grad", "-1"], ["bad --clip-grad -1", "> 0"]),
    (["--clip-mode", "both"], ["bad --clip-mode 'both'", "norm, value"]),
    (["--lr-scale", "cubic"], ["bad --lr-scale 'cubic'", "none, linear, sqrt"]),
    (["--lr-base-batch", "0"], ["bad --lr-base-batch 0"]),
    (["--opt-betas", "0.9,0.99"], ["--opt-betas are adamw's and lamb's", "--opt sgd"]),
    (["--opt", "lamb", "--opt-betas", "0.9"], ["bad --opt-betas '0.9'", "0.9,0.999"]),
    (["--opt", "adamw", "--nesterov"], ["--nesterov is sgd's", "--opt adamw"]),
    (["--opt-eps", "1e-8"], ["--opt-eps is adamw's, lars' and lamb's"]),
    (["--opt", "lars", "--lars-trust", "0"], ["bad --lars-trust 0"]),
    (["--wd-exclude-norm", "yes"], ["bad --wd-exclude-norm 'yes'", "on, off"]),
])
def test_a_bad_recipe_flag_is_one_line_naming_it(flags, words, tmp_path):
    result = run_in_process("train", *TINY, *flags, "--out", tmp_path / "run")
    one_line_error(result, *words)
    assert not (tmp_path / "run").exists()


def test_tandem_fit_names_the_parameter():
    with pytest.raises(UsageError, match=r"^bad optimizer 'adam': choose one of"):
        tandem.fit(None, None, optimizer="adam")
    with pytest.raises(UsageError, match=r"^bad model_ema 1.5"):
        tandem.fit(None, None, model_ema=1.5)


def test_lr_scale_says_and_records_the_scaled_lr(tmp_path):
    out = tmp_path / "scaled"
    result = ok("train", *TINY, "--lr", "0.1", "--lr-scale", "linear", "--lr-base-batch", "16",
                "--accum-steps", "2", "--lr-schedule", "constant", "--max-steps", "1",
                "--out", out)
    line = ("lr 0.2: --lr 0.1 x 32/16 (--lr-scale linear: 32 images per step, -b 16 x "
            "--accum-steps 2, over --lr-base-batch 16)")
    assert line in result.stdout.splitlines(), result.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["optim"]["lr_scale"] == "linear" and config["resolved"]["lr"] == 0.2
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    assert ckpt["tandem_scheduler"]["base_lrs"] == [0.2]
    sqrt = ok("train", *TINY, "--lr", "0.1", "--lr-scale", "sqrt", "--lr-base-batch", "4",
              "--max-steps", "1", "--out", tmp_path / "sqrt")
    assert "lr 0.2: --lr 0.1 x sqrt(16/4) (--lr-scale sqrt" in sqrt.stdout


def test_the_defaults_are_the_imagenet_examples_sgd_unscaled(tmp_path):
    out = tmp_path / "default"
    result = ok("train", *TINY, "--max-steps", "1", "--out", out)
    assert not any(line.startswith("lr ") for line in result.stdout.splitlines())
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    (group,) = ckpt["optimizer"]["param_groups"]  # one group: decay on every parameter
    assert group["weight_decay"] == 5e-4 and group["momentum"] == 0.9 and not group["nesterov"]
    assert "trust" not in group and "ema" not in ckpt
    config = json.loads((out / "config.json").read_text())
    assert config["resolved"]["lr"] == 0.05 and config["resolved"]["wd_exclude_norm"] is False
    assert set(next(iter(ckpt["optimizer"]["state"].values()))) == {"momentum_buffer"}


def test_an_example_file_resumed_under_adamw_says_its_sgd_state_is_not_taken(tmp_path):
    torch.manual_seed(0)
    model = make(10, 1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 1, 8, 8)).sum().backward()
    sgd.step()
    path = tmp_path / "checkpoint.pth.tar"
    torch.save({"epoch": 1, "arch": "recipe_net:make", "state_dict": model.state_dict(),
                "optimizer": sgd.state_dict(), "best_acc1": torch.tensor(10.0)}, path)
    result = ok("train", *TINY, "--resume", path, "--opt", "adamw", "--epochs", "2",
                "--max-steps", "92", "--out", tmp_path / "run")
    assert ("  its optimizer state is SGD's, one group: --opt adamw with --wd-exclude-norm on "
            "starts its own") in result.stdout.splitlines(), result.stdout
    plain = ok("train", *TINY, "--resume", path, "--epochs", "2", "--max-steps", "92",
               "--out", tmp_path / "sgd")
    assert "optimizer state" not in plain.stdout  # SGD takes the file's momentum, as before


def test_the_ema_is_validated_beside_the_weights_chosen_best_and_evaluated(tmp_path):
    out = tmp_path / "ema"
    result = ok("train", *TINY, "--epochs", "2", "--model-ema", "0.95", "--out", out)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all({"ema_val_loss", "ema_val_acc", "ema_val_acc5"} <= set(r) for r in rows)
    assert all(f"| ema val loss {r['ema_val_loss']:.4f} acc {r['ema_val_acc']:.2f}% |" in
               result.stdout for r in rows), result.stdout
    best = max(r["ema_val_acc"] for r in rows)
    assert f"best val acc (of the EMA weights, --model-ema) {best:.2f}%" in result.stdout
    assert rows[0]["ema_val_acc"] != rows[0]["val_acc"]  # two models, two scores
    by_ema = max(rows, key=lambda r: r["ema_val_acc"])
    evaluated = ok("eval", "--resume", out / "best.pt", "--ema", "--json")
    figures = json.loads(evaluated.stdout)
    assert figures["ema"] is True
    assert figures["acc1"] == pytest.approx(by_ema["ema_val_acc"], abs=1e-9)
    assert figures["loss"] == pytest.approx(by_ema["ema_val_loss"], rel=1e-9)
    raw = json.loads(ok("eval", "--resume", out / "best.pt", "--json").stdout)
    assert raw["acc1"] == pytest.approx(by_ema["val_acc"], abs=1e-9)


def test_eval_ema_of_a_run_without_one_is_one_line(tmp_path):
    ok("train", *TINY, "--max-steps", "1", "--out", tmp_path / "plain")
    one_line_error(run_in_process("eval", "--resume", tmp_path / "plain", "--ema"),
                   "holds no EMA of the weights", "--model-ema", "leave out --ema")


def test_fit_takes_the_recipe(tmp_path):
    torch.manual_seed(0)
    images, targets = torch.randn(40, 1, 8, 8), torch.randint(0, 4, (40,))
    data = torch.utils.data.TensorDataset(images, targets)
    row = tandem.fit(make(4, 1), data, data, strategy="hybrid", devices="cpu:2", batch_size=10,
                     epochs=1, out=str(tmp_path / "fit"), optimizer="lamb", lr=0.01,
                     clip_grad=0.1, model_ema=0.9, lr_scale="sqrt", lr_base_batch=40,
                     no_progress=True)
    assert row["clipped_steps"] == 4 and "ema_val_acc" in row
    config = json.loads((tmp_path / "fit" / "config.json").read_text())
    assert config["optim"]["optimizer"] == "lamb" and config["resolved"]["lr"] == 0.005


def _loop_step(scaler, *, unscale: bool = True):
    """One step of the loop (train_batch) on Tiny with --clip-grad 0.01 and ``scaler``."""
    torch.manual_seed(0)
    strategy = create_strategy("single", [torch.device("cpu")])
    model = strategy.setup(Tiny())
    cfg = TrainConfig(optim=OptimConfig(batch_size=6, clip_grad=0.01, label_smoothing=0.0,
                                        lr_schedule="constant", lr=0.5),
                      run=RunConfig(no_progress=True))
    optimizer = make_optimizer(cfg.optim, model.parameters())
    trainer = Trainer(cfg=cfg, strategy=strategy, model=model,
                      criterion=torch.nn.CrossEntropyLoss(), optimizer=optimizer,
                      scheduler=make_scheduler(optimizer, cfg.optim, 10), scaler=scaler,
                      train_set=torch.utils.data.TensorDataset(torch.zeros(60, 3, 8, 8),
                                                               torch.zeros(60)),
                      val_set=None, batches_per_epoch=10, config_dict={},
                      clip=make_clip(cfg.optim, strategy.plain_norms(model)))
    if not unscale:  # the control: the clip sees the scaled gradients (step unscales after)
        calls, unscale_ = [], scaler.unscale_
        scaler.unscale_ = lambda optimizer: calls.append(1) if not calls else unscale_(optimizer)
    run = trainer.begin_epoch()
    x, y = torch.randn(6, 3, 8, 8), torch.randint(0, 5, (6,))
    assert trainer.train_batch(run, 0, x, y)
    run.progress.close()
    return [p.detach().clone() for p in model.parameters()]


def test_the_clip_sees_the_gradients_unscaled_under_grad_scaling():
    """GradScaler's powers of two scale and unscale exactly: the scaled step's weights are the
    unscaled step's bit for bit, and clipping the scaled gradients (the control) is not."""
    plain = _loop_step(torch.amp.GradScaler("cpu", enabled=False))
    scaled = _loop_step(torch.amp.GradScaler("cpu", init_scale=2.0 ** 10))
    assert all(torch.equal(a, b) for a, b in zip(plain, scaled))
    wrong = _loop_step(torch.amp.GradScaler("cpu", init_scale=2.0 ** 10), unscale=False)
    assert max(float((a - b).abs().max()) for a, b in zip(plain, wrong)) > 1e-3
