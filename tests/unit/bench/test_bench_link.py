"""The bench's link plan (bench/link.py) against bytes counted by hand from the model's layers;
--link-rate's parser against rates written out by hand. Nothing is run or timed."""

from __future__ import annotations

import pytest
from torch import nn

from tandem_bench import BenchConfig
from tandem_bench.link import format_rate, parse_rate, plan_link
from tandem.errors import UsageError
from tandem.hybrid.cost import step_bytes


class Headed(nn.Module):
    """A conv trunk and a column/row pair of Linear layers: 16 -> 12 -> 5."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(2), nn.Flatten())
        self.classifier = nn.Sequential(nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 5))

    def forward(self, x):
        return self.classifier(self.features(x))


def _headless() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 5, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten())


@pytest.mark.parametrize("text, bytes_per_s", [
    ("100mbit", 100e6 / 8), ("1gbit", 1e9 / 8), ("1Gbit/s", 1e9 / 8), ("12.5MB/s", 12.5e6),
    ("12.5MB", 12.5e6), ("2MiB/s", 2 * 2 ** 20), ("1e3kbit", 1e6 / 8), (".5GB/s", 0.5e9),
    (" 10 kB/s ", 1e4),
])
def test_a_link_rate_in_bits_or_bytes_is_bytes_per_second(text, bytes_per_s):
    assert parse_rate(text) == pytest.approx(bytes_per_s, rel=1e-12)


@pytest.mark.parametrize("text, why", [
    ("100", "give a rate with its unit"), ("100mb", "give a rate with its unit"),
    ("100mbps", "give a rate with its unit"), ("fast", "give a rate with its unit"),
    ("-1mbit", "give a rate with its unit"), ("100mbit/h", "give a rate with its unit"),
    ("0gbit", "must be > 0 and finite"), ("1e999gbit", "must be > 0 and finite"),
])
def test_a_bad_link_rate_is_one_line_naming_the_parameter(text, why):
    for refuse in (lambda: parse_rate(text),
                   lambda: BenchConfig(arch="cifar_resnet20", link_rate=text)):
        with pytest.raises(UsageError) as info:
            refuse()
        message = str(info.value)
        assert message == f"bad link_rate {text!r}: {why}" + (
            ", e.g. 100mbit, 1gbit or 12.5MB/s" if why.startswith("give") else "")
        assert info.value.params == ("link_rate",)


def test_format_rate_reads_back_what_parse_rate_read():
    for text in ("100 Mbit/s", "1 Gbit/s", "12.5 Gbit/s", "64 kbit/s"):
        assert format_rate(parse_rate(text.replace(" ", ""))) == text


@pytest.mark.parametrize("processes", [2, 3])
def test_the_plan_is_the_bytes_counted_by_hand(processes):
    """ddp sends every gradient in a ring, 2 (W-1)/W of them; the hybrid its trunk's, and the
    head's input gathered and the row layer's output reduce-scattered, each way."""
    model, batch, e = Headed(), 8, 4
    w = processes
    trunk = sum(p.numel() for p in model.features.parameters())
    every = sum(p.numel() for p in model.parameters())
    most = -(-batch // w)  # the largest share
    each_way = (w - 1) * most * (16 + 5) * e
    plan = plan_link(model, batch, w)
    record = plan.record(None, None)["bytes_per_step"]
    assert record["ddp"]["total"] == round(2 * (w - 1) / w * every * e)
    assert record["hybrid-ddp"]["by_kind"] == {
        "gradients": round(2 * (w - 1) / w * trunk * e), "buffers": 0,
        "activations": each_way, "activation_grads": each_way}
    assert plan.totals() == {"ddp": pytest.approx(2 * (w - 1) / w * every * e),
                             "hybrid-ddp": pytest.approx(2 * (w - 1) / w * trunk * e
                                                         + 2 * each_way)}


def test_explain_with_a_head_gives_the_bytes_and_at_a_rate_their_time():
    model = Headed()
    plan, rate = plan_link(model, 8, 2), parse_rate("100mbit")
    cost = step_bytes(model, 8, 2)
    # by hand, each rank: ddp every gradient (112 + 204 + 65 parameters, 4 bytes each); the
    # hybrid the trunk's 112, and 4 rows of the head's 16 inputs and 5 outputs, each way
    ddp_s, hybrid_s = 381 * 4 / rate, (112 * 4 + 2 * 4 * (16 + 5) * 4) / rate
    assert plan.seconds(rate) == {"ddp": pytest.approx(ddp_s), "hybrid-ddp": pytest.approx(hybrid_s)}
    assert plan.seconds(10 * rate)["ddp"] == pytest.approx(ddp_s / 10)  # the rate is used
    text = plan.report(rate)
    lines = text.splitlines()
    assert text.startswith(cost.report())
    assert lines[-2] == (f"link at 100 Mbit/s (--link-rate): ddp {ddp_s * 1e3:.3g} ms, "
                         f"hybrid-ddp {hybrid_s * 1e3:.3g} ms ({hybrid_s / ddp_s:.2f}x ddp's) "
                         "of communication a step (the busiest rank's bytes over the rate, no "
                         "overlap with compute)")
    # ddp's gradients compressed: bf16 two bytes a value (PowerSGD's rows: the unit tests)
    bf16 = 381 * 2
    assert lines[-1].startswith(f"ddp --grad-compression at 100 Mbit/s, a lossy update that "
                                f"auto never picks: bf16 {bf16 / 1e6:.3g} MB (0.50x) "
                                f"{bf16 / rate * 1e3:.3g} ms, powersgd:1 "), lines[-1]
    assert plan.report().splitlines()[-2].startswith("link: give --link-rate (e.g. 100mbit")
    assert plan.seconds(0.0) is None and plan.measured_line(0.0, 1) is None  # one process
    record = plan.record(rate, 2 * rate)
    assert record["predicted_s"]["given"]["ddp"] == pytest.approx(ddp_s)
    assert record["predicted_s"]["measured"]["hybrid-ddp"] == pytest.approx(hybrid_s / 2)
    measured = plan.measured_line(2 * rate, 2)
    assert measured.startswith("link: 200 Mbit/s measured by an all-reduce in the torchrun "
                               f"phase (2 processes on this machine): ddp {ddp_s / 2 * 1e3:.3g}")
    assert plan.measured_line(None, 2) is None
    assert plan_link(model, 8, 1).report(rate).splitlines()[-1] == (
        "link: one process sends nothing (--link-processes N plans N)")


def test_explain_without_a_head_says_why_there_is_no_plan():
    plan = plan_link(_headless(), 8, 2)
    text = plan.report(parse_rate("1gbit"))
    assert text.startswith("bytes sent per step per process: Sequential, no plan: hybrid-ddp "
                           "needs a Linear head to split")
    assert len(text.splitlines()) == 1
    record = plan.record(125e6, 1e9)
    assert record["bytes_per_step"] == {} and record["not_planned"].startswith("needs a Linear")
    assert record["predicted_s"] == {"given": None, "measured": None}
    assert record["rates_bytes_per_s"] == {"given": 125e6, "measured": 1e9}
    assert plan.measured_line(1e9, 2) == ("link: 8 Gbit/s measured by an all-reduce in the "
                                          "torchrun phase (2 processes on this machine)")


def test_a_cpu_run_plans_the_bytes_gloo_sends():
    """gloo (the CPU's backend) reduce-scatters by an all-reduce: twice the bytes, by hand."""
    from tandem_bench.cli import _planned
    from tandem.models import create_model
    from tandem.strategies.auto import wire_backend

    w, batch, e = 2, 8, 4
    each_in, each_out = (w - 1) * (batch // w) * 16 * e, (w - 1) * (batch // w) * 5 * e
    by_kind = plan_link(Headed(), batch, w, backend=wire_backend("cpu")).record(
        None, None)["bytes_per_step"]["hybrid-ddp"]["by_kind"]
    assert by_kind["activations"] == each_in + 2 * each_out  # row outputs reduce-scattered
    assert by_kind["activation_grads"] == 2 * each_in + each_out  # column inputs' gradients
    config = BenchConfig(arch="cifar_resnet20", devices="cpu:2", baselines="none")
    model = create_model(config.arch, num_classes=config.num_classes)
    gloo, nccl = (step_bytes(model, config.batch_size, 2, backend=b) for b in ("gloo", "nccl"))
    planned = _planned(config)
    assert planned["hybrid-ddp"] == round(gloo.most(gloo.hybrid)) > nccl.most(nccl.hybrid)
