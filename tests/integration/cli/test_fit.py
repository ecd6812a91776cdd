"""tandem.fit compared with `single`: a model and data sets of the user's own
(tests/support/own_model.py, not the zoo) reach single's weights after 3 steps under dp, balanced
and 2-process ddp (float64, with the controls of tests/support/exact.py); a fit resumed equals one
straight fit bit for bit; its settings are checked as the CLI's, in one line."""

import json
import sys

import pytest
import torch
from conftest import SUPPORT, cli_env, run_bounded
from exact import check_invariance, same_bits
from own_model import Net, Pairs

import tandem
from tandem.errors import UsageError
from tandem.train.datawait import TIMING_FIELDS

# 30 samples in global batches of 7: 5 batches an epoch, the last one 2; 3 steps stop mid-epoch
STEPS = dict(batch_size=7, epochs=2, max_steps=3, seed=3, no_progress=True)


# one list: a second `pytestmark =` would replace the first
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def fit(out, model=None, **settings):
    torch.manual_seed(0)  # the user's model: its initial weights are the user's
    if out is not None:
        settings["out"] = str(out)
    return tandem.fit(Net() if model is None else model, Pairs(30, seed=0), Pairs(11, seed=1),
                      **settings)


def ckpt(path):
    return torch.load(path / "checkpoint.pt", weights_only=True)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """single in float64, the same in float32 (noise floor) and dp without sync_bn (negative
    control: the model has BatchNorm, so per-replica statistics are another update)."""
    out = tmp_path_factory.mktemp("single")
    fit(out / "f64", **STEPS, dtype="float64")
    fit(out / "f32", **STEPS)
    fit(out / "negative", **STEPS, dtype="float64", strategy="dp", devices="cpu:2")
    return out


def matches_single(single, candidate):
    check_invariance(single / "f64" / "checkpoint.pt", {"candidate": candidate},
                     reference32=single / "f32" / "checkpoint.pt",
                     negative64=single / "negative" / "checkpoint.pt")


@pytest.mark.parametrize("strategy", [dict(strategy="dp", devices="cpu:2", sync_bn=True),
                                      dict(strategy="balanced", devices="cpu:3", sync_bn=True)])
def test_fit_reaches_singles_weights(single, strategy, tmp_path):
    row = fit(tmp_path, **STEPS, **strategy, dtype="float64")
    assert row["step"] == 3 and row["partial"]
    matches_single(single, tmp_path / "checkpoint.pt")


@pytest.mark.distributed
def test_fit_under_torchrun_is_one_rank_of_ddp(single, tmp_path):
    """The same call in a script started by torchrun: every process runs it as ddp."""
    script = tmp_path / "job.py"
    script.write_text(
        "import os, sys\n"
        f"sys.path.insert(0, {str(SUPPORT)!r})\n"  # own_model.py
        "import torch, tandem\n"
        "from own_model import Net, Pairs\n"
        "torch.manual_seed(0)\n"
        f"row = tandem.fit(Net(), Pairs(30, seed=0), Pairs(11, seed=1), out={str(tmp_path / 'run')!r},"
        f" strategy='dp', devices='cpu:2', sync_bn=True, dtype='float64', **{STEPS!r})\n"
        # one string, one write: the ranks share torchrun's pipe
        "print(f\"rank {os.environ['RANK']} row {None if row is None else row['step']}\")\n"
        "tandem.exit(0)  # as `tandem` ends: no interpreter finalization racing gloo's threads\n")
    result = run_bounded([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2", str(script)], 240,
                         cli_env(PYTHONWARNINGS="ignore"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "under torchrun: strategy ddp on cpu" in result.stdout
    assert "rank 0 row 3" in result.stdout and "rank 1 row None" in result.stdout
    saved = ckpt(tmp_path / "run")
    assert saved["config"]["resolved"]["world_size"] == 2
    assert saved["config"]["parallel"]["strategy"] == "ddp"
    matches_single(single, tmp_path / "run" / "checkpoint.pt")


def test_fit_then_resume_equals_one_straight_fit_bitwise(tmp_path):
    settings = dict(batch_size=7, epochs=2, seed=3, no_progress=True)
    straight = fit(tmp_path / "straight", **settings)
    fit(tmp_path / "split", **settings, max_steps=3)
    model = Net()  # other weights: a resume takes the checkpoint's
    resumed = fit(None, model=model, resume=str(tmp_path / "split"))  # in its own directory
    a, b = ckpt(tmp_path / "straight"), ckpt(tmp_path / "split")
    assert not same_bits(a["state_dict"], b["state_dict"])
    assert not same_bits(a["optimizer"], b["optimizer"])
    assert a["data_position"] == b["data_position"] == {"epoch": 2, "batch": 0, "step": 10}
    assert {k: v for k, v in resumed.items() if k not in TIMING_FIELDS} == \
        {k: v for k, v in straight.items() if k not in TIMING_FIELDS}
    # the model handed over holds the final weights
    assert not same_bits({k: v for k, v in model.state_dict().items()}, b["state_dict"])
    config = b["config"]
    assert config["model"]["arch"] == "own_model:Net"
    assert config["data"]["data"] == "given-to-tandem.fit"
    rows = [line for line in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2


def test_fit_keys_the_dropout_of_a_handed_model(tmp_path):
    """tandem.fit converts a handed model's nn.Dropout layers too (AlexNet's classifier,
    tests/support/dropout_net.py): 3 CPU replicas equal single in float64; under
    ``dropout_rng="torch"`` they do not (torch's draws depend on the replicas)."""
    from dropout_net import alexnet_like
    from exact import TOL64, max_diff

    def run(name, **settings):
        torch.manual_seed(0)
        fit(tmp_path / name, model=alexnet_like(3, 1), **STEPS, dtype="float64", **settings)
        return ckpt(tmp_path / name)["state_dict"]

    single, dp = run("single"), run("dp", strategy="dp", devices="cpu:3")
    assert max_diff(single, dp) < TOL64
    single_torch = run("single_torch", dropout_rng="torch")
    dp_torch = run("dp_torch", strategy="dp", devices="cpu:3", dropout_rng="torch")
    assert max_diff(single_torch, dp_torch) > 1e-4


def test_no_val_data_and_own_criterion(tmp_path, capsys):
    """Without val_data: the lines say so (no nan, no "best val acc 0.00%"), no best.pt is
    written, and the returned row holds null validation fields, as metrics.jsonl does."""
    torch.manual_seed(0)
    calls = []

    def criterion(outputs, targets):
        calls.append(len(targets))
        return torch.nn.functional.cross_entropy(outputs, targets)

    row = tandem.fit(Net(), Pairs(30, seed=0), None, criterion=criterion, batch_size=10,
                     epochs=2, out=str(tmp_path), no_progress=True)
    assert calls == [10] * 6 and row["step"] == 6 and row["train_loss"] > 0
    printed = capsys.readouterr().out
    assert "nan" not in printed and "best val acc" not in printed
    assert printed.count("| no validation data |") == 2
    assert printed.splitlines()[-1] == (f"no validation data (val_data=None), so no best.pt: "
                                        f"the last weights are in {tmp_path / 'checkpoint.pt'}")
    assert (row["val_loss"], row["val_acc"], row["val_acc5"]) == (None, None, None)
    assert not (tmp_path / "best.pt").exists()
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert {k: last[k] for k in ("val_loss", "val_acc")} == {"val_loss": None, "val_acc": None}


@pytest.mark.parametrize("settings, line", [
    (dict(epoch=3), "tandem.fit() got an unknown setting 'epoch': did you mean epochs?"),
    (dict(batch_size="8"), "bad batch_size '8': must be int"),
    (dict(batch_size=0), "bad batch_size 0: must be >= 1"),  # the parameter, not --batch-size
    (dict(lr=-1), "bad lr -1: must be > 0"),
    (dict(strategy="nope"), "unknown strategy 'nope'"),
    (dict(arch="cifar_resnet20"), "tandem.fit() got a model and arch=: give one of them"),
    (dict(augment="standard"), "augment 'standard' applies to tandem's own data sets"),
    (dict(drop_path=0.1), "drop_path 0.1 is for a model tandem builds"),
    (dict(dropout_rng="numpy"), "bad dropout_rng 'numpy': choose one of keyed, torch"),
])
def test_settings_are_checked_in_one_line(settings, line, tmp_path):
    with pytest.raises(UsageError) as info:
        fit(tmp_path, **settings)
    first, *rest = str(info.value).splitlines()  # one line, and maybe its remedy's
    assert first.startswith(line) and len(rest) <= 1
    assert all(remedy.startswith("hint: ") for remedy in rest)
    assert not tmp_path.joinpath("checkpoint.pt").exists()


def test_data_that_is_not_pairs_is_refused(tmp_path):
    with pytest.raises(UsageError, match=r"train data\[0\] is a Tensor, not an \(input, target\)"):
        tandem.fit(Net(), torch.zeros(4, 1, 8, 8), out=str(tmp_path))
    with pytest.raises(UsageError, match="int64 input: give floating-point inputs"):
        tandem.fit(Net(), [(torch.zeros(1, 8, 8, dtype=torch.long), 0)], out=str(tmp_path))


def test_dense_targets_need_named_classes_and_batch_as_tensors():
    """A data set of (image, mask) pairs: its batches stack the masks (an empty share gives a
    (0, H, W) batch), and a class count is never guessed from mask values (255 is ignored)."""
    from torch.utils.data import TensorDataset

    from tandem.data.given import given_data
    from tandem.data.loader import collate
    from tandem.errors import UsageError

    masks = torch.randint(0, 3, (5, 4, 4))
    masks[:, 0] = 255
    data = TensorDataset(torch.rand(5, 3, 4, 4), masks)
    with pytest.raises(UsageError, match=r"gives dense targets \(4, 4\): name the classes"):
        given_data(data, data, name="mine")
    train, _, info = given_data(data, data, ("a", "b", "c"), name="mine")
    assert info.num_classes == 3 and train.target_shape == (4, 4)
    images, targets = collate([train[(i, 0, 0)] for i in range(2)], shape=train.shape,
                              target_shape=train.target_shape)
    assert targets.dtype == torch.int64 and torch.equal(targets, masks[:2])
    _, empty = collate([], shape=train.shape, target_shape=train.target_shape)
    assert empty.shape == (0, 4, 4)
