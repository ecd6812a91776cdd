"""The cost model (tandem.hybrid.cost): plan()'s parameters, MACs and bytes between devices, and
step_bytes()'s bytes each process sends, checked against hand computations. The wire's count is
tests/integration/two_machines/test_wire_bytes.py's."""

import pytest
import torch
from torch import nn

from tandem.hybrid import HybridParallel, plan
from tandem.hybrid.cost import step_bytes
from tandem.hybrid.layout import classifier_layout


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU())
        self.avgpool = nn.AdaptiveAvgPool2d(2)
        self.classifier = nn.Sequential(nn.Dropout(0.0), nn.Linear(16, 6), nn.ReLU(),
                                        nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def test_layout_rule():
    leading, stages = classifier_layout(Tiny().classifier)
    assert leading == [0]
    assert [(s.kind, s.indices) for s in stages] == [("pair", [1, 2, 3]), ("local", [4]),
                                                     ("column", [5])]
    vgg_like = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Dropout(), nn.Linear(8, 8),
                             nn.BatchNorm1d(8), nn.Linear(8, 8), nn.Linear(8, 2))
    _, stages = classifier_layout(vgg_like)
    assert [(s.kind, s.indices) for s in stages] == [("pair", [0, 1, 2, 3]), ("local", [4]),
                                                     ("pair", [5, 6])]
    with pytest.raises(ValueError, match="nn.Sequential"):
        classifier_layout(nn.Linear(2, 2))


def test_numbers_match_hand_computation():
    # features: conv 3->4, 3x3 on 5x5: 4*3*9+4 = 112 params, 25*4*27 = 2700 MACs per image
    # classifier: 16*6+6 + 6*5+5 + 5*3+3 = 155 params, 96+30+15 = 141 MACs per image
    p = plan(Tiny(), ["cpu"] * 2, batch_size=5, input_size=(3, 5, 5))
    assert (p.params_trunk, p.params_classifier) == (112, 155)
    assert (p.macs_trunk, p.macs_classifier) == (5 * 2700, 5 * 141)
    # chunks [3, 2]: 2 images leave device 0; float32
    assert p.dp_bytes == {"inputs": 2 * 75 * 4, "parameters": 267 * 4, "buffers": 0,
                          "gradients": 267 * 4, "activations": 2 * 2 * 3 * 4}
    # activations: shard 0 fetches 2 images, shard 1 fetches 3 (x16 features); row partials
    # 5 x 5 from shard 1; last column: input 5 x 5 to shard 1, its 5 x 1 output back; x2 for
    # the gradients
    moved = (2 + 3) * 16 + 5 * 5 + 5 * 5 + 5 * 1
    assert p.hybrid_bytes == {"inputs": 600, "parameters": 112 * 4, "buffers": 0,
                              "gradients": 112 * 4, "activations": 2 * moved * 4}
    assert p.dp_total == 2 * 267 * 4 + 48 and p.hybrid_total == 2 * 112 * 4 + 2 * moved * 4
    assert p.ratio == pytest.approx(p.dp_total / p.hybrid_total)
    assert "hybrid moves 1.1x fewer bytes" in p.verdict
    assert p.break_even_batch is not None
    below = plan(Tiny(), 2, batch_size=p.break_even_batch, input_size=(3, 5, 5))
    above = plan(Tiny(), 2, batch_size=p.break_even_batch + 1, input_size=(3, 5, 5))
    assert below.hybrid_total < below.dp_total and above.hybrid_total >= above.dp_total
    assert "data parallel is cheaper here" in above.verdict


def test_batch_smaller_than_devices():
    p = plan(Tiny(), 3, batch_size=2, input_size=(3, 5, 5))  # chunks [1, 1]: 2 replicas used
    assert p.dp_bytes["parameters"] == 1 * 267 * 4
    # column over [2, 2, 2]: shards 0, 1 fetch 1 image, shard 2 fetches 2; row: 2 partials of
    # 2 x 5; last column over [1, 1, 1]: 2 x (2 x 5) out, 2 x 2 x 1 back
    moved = (1 + 1 + 2) * 16 + 2 * 2 * 5 + 2 * 2 * 5 + 2 * 2
    assert p.hybrid_bytes["activations"] == 2 * moved * 4


def test_one_device_and_report_text():
    p = HybridParallel.plan(Tiny(), 1, batch_size=4, input_size=5)
    assert p.dp_total == p.hybrid_total == 0 and "nothing moves" in p.verdict
    text = plan(Tiny(), 2, batch_size=4, input_size=5).report()
    for needle in ("trunk (data parallel)", "classifier.1 Linear 16->6: column over [3, 3]",
                   "row over [3, 3]", "verdict:", "per device"):
        assert needle in text
    assert str(plan(Tiny(), 2, 4, 5)) == text


def test_model_is_not_touched_and_bad_args():
    model = Tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan(model, 2, 8, 5)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="plan needs a Linear head to split: looked for "
                                         ".classifier or .fc on Linear"):
        plan(nn.Linear(2, 2), 2)
    with pytest.raises(ValueError, match="batch_size"):
        plan(model, 2, 0)
    with pytest.raises(ValueError, match="bad device"):
        plan(model, ["cpu", "gpu7"])


class Normed(Tiny):
    """Tiny with a BatchNorm in its trunk: 8 float buffers (its int step counter is not sent)."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())


def test_step_bytes_each_process_sends_by_hand():
    # 7 samples over 3 ranks: shares [3, 2, 2], m = 3 the largest; float32. Parameters: trunk
    # 112 + 8 (BN), head 102 + 35 + 18, all of it split (pair 1-3, local ReLU, column 5)
    cost = step_bytes(Normed(), 7, 3)
    ring, bcast = 2 * 2 / 3, 2 / 3
    assert cost.ddp == [{"gradients": ring * 275 * 4, "buffers": bcast * 8 * 4}] * 3
    # pair: 2 x 3 rows of 16 inputs gathered and 2 x 3 rows of 5 partial sums, each way; the
    # column 5 -> 3 (a block of 1 column a rank): its 5 inputs gathered each way, then its
    # block of the other ranks' rows out (7 - share) and its rows' other 2 columns back
    both = 2 * 3 * 16 * 4 + 2 * 3 * 5 * 4 + 2 * 3 * 5 * 4
    for rank, share in enumerate((3, 2, 2)):
        assert cost.hybrid[rank] == {"gradients": ring * 120 * 4, "buffers": bcast * 8 * 4,
                                     "activations": both + (7 - share) * 1 * 4,
                                     "activation_grads": both + share * 2 * 4}
    assert cost.busiest(cost.hybrid) is cost.hybrid[0]  # 640 + 648, rank 1 644 + 640
    assert cost.most(cost.hybrid) == pytest.approx(ring * 120 * 4 + bcast * 8 * 4 + 640 + 648)
    assert "busiest rank" in cost.report() and str(cost) == cost.report()


def test_step_bytes_in_half_precision_and_over_gloo():
    # 2 bytes an element, but a row layer's partial sums travel in float32; one process sends
    # nothing
    cost = step_bytes(Tiny().half(), 4, 2)
    gathered, summed = 1 * 2 * (16 + 5) * 2, 1 * 2 * 5 * 4
    assert cost.hybrid[0]["activations"] == gathered + summed + 2 * 2 * 2  # 2 rows x 2 columns
    assert cost.ddp[0]["gradients"] == 1 * 267 * 2
    # gloo reduce-scatters by an all-reduce of the whole tensor: the pair's input gradient and
    # its partial sums, and the column's input gradient, twice (float32, rank 0: columns [2, 1])
    gloo = step_bytes(Tiny(), 4, 2, backend="gloo").hybrid[0]
    assert (gloo["activations"], gloo["activation_grads"]) == (
        128 + 2 * 40 + 40 + 2 * 2 * 4, 2 * 128 + 40 + 2 * 40 + 2 * 1 * 4)
    with pytest.raises(ValueError, match="backend must be 'nccl' or 'gloo'"):
        step_bytes(Tiny(), 4, 2, backend="mpi")
    alone = step_bytes(Tiny(), 4, 1)
    assert alone.most(alone.ddp) == alone.most(alone.hybrid) == 0
    with pytest.raises(ValueError, match="step_bytes needs a batch and processes >= 1"):
        step_bytes(Tiny(), 0, 2)
