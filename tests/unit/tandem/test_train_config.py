"""The config dataclasses, the CLI derived from them, the schedule and the metric sums."""

import json
import math

import pytest
import torch

from tandem.cli.common import error_line
from tandem.cli.main import build_parser
from tandem.cli.train import config_from_namespace
from tandem.config import OptimConfig, TrainConfig
from tandem.train.metrics import Meter
from tandem.train.schedule import lr_factor


def parse(*argv):
    return config_from_namespace(build_parser().parse_args(["train", *argv]))


def test_defaults_round_trip_through_json():
    cfg = parse()
    assert cfg == TrainConfig()
    data = json.loads(json.dumps(cfg.to_dict()))
    assert TrainConfig.from_dict(data) == cfg
    assert TrainConfig.from_dict({**data, "from_the_future": 1, "resolved": {}}) == cfg


def test_imagenet_flags_map_to_fields():
    cfg = parse("-a", "resnet18", "-b", "64", "--lr", "0.2", "--momentum", "0.8", "--wd", "1e-3",
                "--epochs", "3", "-j", "2", "--seed", "7", "-e", "--resume", "x.pt", "-p", "5",
                "--strategy", "dp", "--devices", "cpu:3", "--sync-bn", "--buffers", "average",
                "--augment", "standard", "--max-steps", "9", "--accum-steps", "2",
                "--out", "o", "--no-progress")
    assert (cfg.model.arch, cfg.optim.batch_size, cfg.optim.lr, cfg.optim.momentum) == \
        ("resnet18", 64, 0.2, 0.8)
    assert cfg.optim.weight_decay == 1e-3 and cfg.optim.epochs == 3
    assert (cfg.data.workers, cfg.run.seed, cfg.run.evaluate, cfg.run.resume) == \
        (2, 7, True, "x.pt")
    assert (cfg.parallel.strategy, cfg.parallel.devices, cfg.parallel.sync_bn,
            cfg.parallel.buffers) == ("dp", "cpu:3", True, "average")
    assert (cfg.data.augment, cfg.optim.max_steps, cfg.optim.accum_steps) == ("standard", 9, 2)
    assert (cfg.run.out, cfg.run.no_progress, cfg.run.print_freq) == ("o", True, 5)
    assert parse("--weight-decay", "0.01").optim.weight_decay == 0.01


def test_parsing_does_not_mutate_args():
    args = build_parser().parse_args(["train", "-b", "8"])
    before = vars(args).copy()
    config_from_namespace(args)
    assert vars(args) == before


@pytest.mark.parametrize("argv, flag", [
    (["-b", "0"], "--batch-size"), (["--epochs", "0"], "--epochs"),
    (["--lr", "0"], "--lr"), (["--accum-steps", "0"], "--accum-steps"),
    (["--max-steps", "0"], "--max-steps"), (["--augment", "heavy"], "--augment"),
    (["--buffers", "sum"], "--buffers"), (["--lr-schedule", "poly"], "--lr-schedule"),
    (["-j", "-1"], "--workers"), (["--label-smoothing", "1"], "--label-smoothing"),
    (["--image-size", "0"], "--image-size"),
])
def test_bad_values_are_one_line_value_errors_naming_the_flag(argv, flag):
    """The command line's line names the flag; the library's message the parameter."""
    with pytest.raises(ValueError) as info:
        parse(*argv)
    line = error_line(info.value)
    assert flag in line and "\n" not in line
    assert f"bad {flag[2:].replace('-', '_')} " in str(info.value), str(info.value)


def test_help_lists_every_field(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    text = capsys.readouterr().out
    for flag in ("--arch", "--batch-size", "--wd", "--strategy", "--devices", "--sync-bn",
                 "--buffers", "--augment", "--max-steps", "--accum-steps", "--out",
                 "--no-progress", "--amp", "--channels-last", "--resume", "--evaluate",
                 "--label-smoothing", "--lr-schedule", "--warmup-epochs", "--workers"):
        assert flag in text


def test_schedules():
    cfg = OptimConfig(epochs=2, lr_schedule="cosine")
    assert lr_factor(0, cfg, 10) == 1.0
    assert lr_factor(10, cfg, 10) == pytest.approx(0.5)
    assert lr_factor(20, cfg, 10) == pytest.approx(0.0, abs=1e-12)
    step = OptimConfig(epochs=9, lr_schedule="step", lr_step=3, lr_gamma=0.1)
    assert [lr_factor(s, step, 4) for s in (0, 11, 12, 24)] == \
        pytest.approx([1.0, 1.0, 0.1, 0.01])
    warm = OptimConfig(epochs=4, lr_schedule="constant", warmup_epochs=1)
    assert [lr_factor(s, warm, 4) for s in (0, 3, 4)] == [0.25, 1.0, 1.0]


class _TwoProcesses:
    """A strategy stand-in whose all_reduce doubles: as if a second rank held the same sums."""

    device = torch.device("cpu")

    def all_reduce_sum(self, t):
        return t * 2


def test_meter_sums_weight_by_count_and_skip_empty_shares():
    m = Meter()
    m.update(torch.tensor(1.0), torch.tensor(3), 4)
    m.update(torch.tensor(4.0), torch.tensor(0), 2)
    m.update(torch.tensor(float("nan")), torch.tensor(0), 0)  # an empty share
    assert m.loss == pytest.approx(2.0) and m.acc == pytest.approx(50.0)
    r = m.reduced(_TwoProcesses())
    assert (r.count, r.correct) == (12, 6) and r.loss == pytest.approx(2.0)
    assert math.isnan(Meter().loss)


def test_optimizer_state_of_another_layout_is_refused():
    from tandem.train.build import _check_optimizer_shapes

    def sgd(*shapes):
        params = [torch.nn.Parameter(torch.ones(s)) for s in shapes]
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    saved = sgd((4, 2), (4,))
    sum(p.sum() for g in saved.param_groups for p in g["params"]).backward()
    saved.step()  # creates momentum buffers
    same, other = sgd((4, 2), (4,)), sgd((2, 2), (4,))  # same count, another shape
    same.load_state_dict(saved.state_dict())
    _check_optimizer_shapes(same, "ok.pt")
    other.load_state_dict(saved.state_dict())  # torch accepts it silently
    with pytest.raises(ValueError, match="bad.pt.*momentum_buffer"):
        _check_optimizer_shapes(other, "bad.pt")
