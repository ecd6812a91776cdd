"""``--grad-compression``'s values, the bytes it sends against hand counts, and the CLI's
refusals (the runs under two processes: tests/integration/torchrun/test_grad_compression.py)."""

import pytest
import torch
from conftest import run_in_process
from torch import nn

from tandem.distributed.compression import NONE, Compression
from tandem.errors import UsageError
from tandem.hybrid.cost import gradient_bytes, step_bytes


def _net() -> nn.Module:
    """conv 8x3x3x3 (216 weights, as a matrix 8x27) and its 8 biases; a Linear 288->10 (2,880
    weights, 10x288) and its 10 biases: 3,114 float32 values."""
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 10))


@pytest.mark.parametrize("text, mode, rank", [("none", "none", 0), ("bf16", "bf16", 0),
                                              ("fp16", "fp16", 0), ("powersgd", "powersgd", 1),
                                              ("powersgd:4", "powersgd", 4)])
def test_a_value_names_the_mode_and_powersgds_rank(text, mode, rank):
    c = Compression.parse(text)
    assert (c.mode, c.rank) == (mode, rank)
    assert str(c) == (text if text != "powersgd" else "powersgd:1")


@pytest.mark.parametrize("text, says", [("bf17", "did you mean bf16"),
                                        ("bf16:2", "takes no rank"),
                                        ("powersgd:0", "whole number >= 1"),
                                        ("powersgd:x", "whole number >= 1")])
def test_a_bad_value_is_one_line_naming_the_flag(text, says):
    with pytest.raises(UsageError, match=says) as refused:
        Compression.parse(text)
    assert "grad_compression" in str(refused.value) or "--grad-compression" in str(refused.value)


@pytest.mark.parametrize("text, expected", [
    ("none", 3114 * 4),
    ("bf16", 3114 * 2), ("fp16", 3114 * 2),
    # rank 1: the conv's 8x27 as (8+27) values, the Linear's 10x288 as (10+288); biases whole
    ("powersgd:1", (35 + 8 + 298 + 10) * 4),
    # rank 4: the conv's factors (35*4 = 140 values) would not halve its 216: sent whole
    ("powersgd:4", (216 + 8 + 298 * 4 + 10) * 4)])
def test_the_bytes_sent_are_the_hand_count(text, expected):
    net = _net()
    assert Compression.parse(text).sent_bytes(net.parameters()) == expected
    # a ring all-reduce over W ranks sends 2 (W-1)/W of it; ddp's row of the cost model too
    assert gradient_bytes(net.parameters(), 4, Compression.parse(text)) == expected * 1.5
    model = nn.Sequential(net, nn.Linear(10, 4))  # a head for the hybrid's row
    head = (10 * 4 + 4) * 4
    cost = step_bytes(model, 8, 2, head="1", compression=Compression.parse(text))
    assert cost.ddp[0]["gradients"] == pytest.approx(expected + Compression.parse(text)
                                                     .sent_bytes(model[1].parameters()))
    assert cost.hybrid[0]["gradients"] == pytest.approx(expected)  # the head is split: not sent
    assert step_bytes(model, 8, 2, head="1").ddp[0]["gradients"] == 3114 * 4 + head


def test_none_is_exact_and_float64_counts_its_own_bytes():
    assert NONE.exact and not Compression.parse("bf16").exact
    net = _net().to(torch.float64)
    assert NONE.sent_bytes(net.parameters()) == 3114 * 8
    assert Compression.parse("bf16").sent_bytes(net.parameters()) == 3114 * 2


@pytest.mark.parametrize("flags, says", [
    (["--strategy", "single"], "needs a strategy that compresses its gradients (ddp, hybrid-ddp"),
    (["--strategy", "dp", "--devices", "cpu:2"], "not --strategy dp"),
    (["--strategy", "auto"], "auto never picks that by itself")])
def test_strategies_that_cannot_compress_and_auto_refuse_it(tmp_path, flags, says):
    result = run_in_process("train", "--data", "digits", "--epochs", "1", *flags,
                            "--grad-compression", "bf16", "--out", tmp_path / "run")
    assert result.returncode == 2, result.stderr
    assert says in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()
