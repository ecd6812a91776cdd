"""mixup and cutmix against hand-computed cases and against the whole batch mixed in one piece:
each share of a global batch (any split over ranks, empty shares, any worker count) mixes its
samples, bit for bit, as the whole batch mixes them."""

import math

import pytest
import torch
from conftest import one_line_error, run_in_process

from tandem.data import load_dataset, make_loader
from tandem.data.mixing import MixDraw, Mixing, cut_box, mix, pair, soft_targets
from tandem.parallel.shares import shares
from tandem.strategies.outputs import hits

MIXING = Mixing(mixup=0.2, cutmix=1.0, num_classes=5)


def test_draws_are_keyed_by_the_global_batch_alone():
    a, b = MIXING.draw(3, 1, 4, 9), MIXING.draw(3, 1, 4, 9)
    assert a == b
    assert sorted(a.partner) == list(range(9))
    assert {MIXING.draw(3, 1, k, 9) for k in range(6)} != {a}  # another batch, other draws
    kinds = {MIXING.draw(0, 0, k, 8).kind for k in range(40)}
    assert kinds == {"mixup", "cutmix"}  # switch probability 0.5, mix probability 1
    assert Mixing(mixup=0.2, prob=0.0, num_classes=5).active is False
    assert {Mixing(mixup=0.2, prob=0.5, num_classes=5).draw(0, 0, k, 8).kind
            for k in range(40)} == {"mixup", "none"}


def test_mixup_by_hand():
    """Two samples, each the other's partner, lam 0.75: 3/4 of itself, 1/4 of the other."""
    draw = MixDraw(partner=(1, 0), kind="mixup", lam=0.75, centre=(0.5, 0.5))
    images = torch.tensor([[[[4.0]]], [[[8.0]]]], dtype=torch.float64)
    labels = torch.tensor([2, 0])
    mixed, targets = mix(images, labels, pair(draw, 0, 2, 3))
    assert mixed.flatten().tolist() == [5.0, 7.0]  # 0.75*4 + 0.25*8, 0.75*8 + 0.25*4
    assert targets.tolist() == [[0.25, 0.0, 0.75], [0.75, 0.0, 0.25]]
    assert targets.dtype == torch.float64


def test_cutmix_box_and_its_lam_by_hand():
    """timm's rand_bbox: sides int(8 * sqrt(1 - lam)) = 4 around the centre (4, 4): rows and
    columns 2..5; lam corrected to the box's area, 1 - 16/64."""
    assert cut_box((0.5, 0.5), 0.75, 8, 8) == (2, 6, 2, 6)
    assert cut_box((0.0, 0.99), 0.75, 8, 8) == (0, 2, 5, 8)  # clipped at the edges
    draw = MixDraw(partner=(1, 0), kind="cutmix", lam=0.75, centre=(0.0, 0.99))
    images = torch.stack([torch.zeros(1, 8, 8), torch.ones(1, 8, 8)])
    mixed, targets = mix(images, torch.tensor([0, 1]), pair(draw, 0, 2, 2))
    expected = torch.zeros(8, 8)
    expected[0:2, 5:8] = 1  # the partner's box pasted in
    assert torch.equal(mixed[0, 0], expected) and torch.equal(mixed[1, 0], 1 - expected)
    lam = 1 - 6 / 64
    assert targets[0].tolist() == pytest.approx([lam, 1 - lam])


def test_soft_targets_give_an_ignored_label_no_weight():
    t = soft_targets(torch.tensor([1, -100]), torch.tensor([-100, 0]), 0.6, 3, torch.float32)
    assert torch.allclose(t, torch.tensor([[0.0, 0.6, 0.0], [0.4, 0.0, 0.0]]))


def test_an_unmixed_batch_pairs_each_sample_with_itself():
    draw = MixDraw(partner=(2, 0, 1), kind="none", lam=1.0, centre=(0.1, 0.2))
    pairing = pair(draw, 1, 3, 4)
    assert pairing.gather == (0, 1) and pairing.extra == ()
    images = torch.randn(2, 3, 4, 4)
    mixed, targets = mix(images, torch.tensor([3, 1]), pairing)
    assert torch.equal(mixed, images)
    assert targets.tolist() == [[0, 0, 0, 1], [0, 1, 0, 0]]


@pytest.mark.parametrize("size", [1, 2, 7])
@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_share_mixes_as_the_whole_batch_does(size, ranks, dtype):
    """The shares (uneven, empty when the batch is smaller than the ranks) each load their own
    samples and the partners they lack; mixed, they are the whole batch's rows, bit for bit."""
    g = torch.Generator().manual_seed(size)
    images = torch.randn(size, 3, 6, 5, generator=g).to(dtype)
    labels = torch.randint(0, 5, (size,), generator=g)
    for batch in range(8):  # mixup and cutmix batches both
        draw = MIXING.draw(7, 0, batch, size)
        whole, whole_targets = mix(images, labels, pair(draw, 0, size, 5))
        rows, row_targets, lo = [], [], 0
        for n in shares(size, [1] * ranks):
            pairing = pair(draw, lo, lo + n, 5)
            held = torch.cat([images[lo:lo + n], images[list(pairing.extra)]])
            held_labels = torch.cat([labels[lo:lo + n], labels[list(pairing.extra)]])
            got, got_targets = mix(held, held_labels, pairing)
            rows.append(got)
            row_targets.append(got_targets)
            lo += n
        assert torch.equal(torch.cat(rows), whole), (batch, draw.kind)
        assert torch.equal(torch.cat(row_targets), whole_targets)


def test_shares_need_partners_they_do_not_hold():
    """The exact way costs loads: under 2 ranks most partners sit on the other rank."""
    draw = MIXING.draw(0, 0, 0, 8)
    assert sum(len(pair(draw, lo, lo + 4, 5).extra) for lo in (0, 4)) > 0


def _mixed_batches(train, world, workers):
    """Each global batch of one epoch as every rank's mixed shares, joined in rank order."""
    per_rank = [[b[2].mix(b[0], b[1]) for b in make_loader(
        train, 5, shuffle=True, seed=3, epoch=1, rank=r, world_size=world, workers=workers,
        mix=MIXING)] for r in range(world)]
    return [tuple(torch.cat([rank[i][k] for rank in per_rank]) for k in (0, 1))
            for i in range(len(per_rank[0]))]


def test_loaders_of_any_ranks_and_workers_give_the_same_mixed_batches():
    train, _, _ = load_dataset("synthetic", augment="standard", synthetic_size=11,
                               image_size=8, num_classes=5)
    alone = _mixed_batches(train, 1, 0)
    assert [x.shape[0] for x, _ in alone] == [5, 5, 1]
    for world, workers in ((2, 0), (3, 2)):
        for (x, y), (x1, y1) in zip(_mixed_batches(train, world, workers), alone):
            assert torch.equal(x, x1) and torch.equal(y, y1)
    plain = [x for x, _ in make_loader(train, 5, shuffle=True, seed=3, epoch=1)]
    assert not torch.equal(plain[0], alone[0][0])  # mixing changed the images


def test_accuracy_against_mixed_targets_counts_the_dominant_label():
    outputs = torch.tensor([[2.0, 1.0, 0.0], [0.0, 1.0, 2.0]])
    targets = torch.tensor([[0.7, 0.3, 0.0], [0.0, 0.6, 0.4]])  # dominant: 0, 1
    correct, correct5, confusion = hits(outputs, targets, -100)
    assert int(correct) == 1 and int(correct5) == 2 and confusion is None


@pytest.mark.parametrize("flag, value, words", [
    ("--mixup", "-1", ["bad --mixup -1", ">= 0"]),
    ("--cutmix", "nan", ["bad --cutmix nan"]),
    ("--mix-prob", "1.5", ["bad --mix-prob 1.5", "[0, 1]"]),
    ("--mix-switch-prob", "-0.1", ["bad --mix-switch-prob -0.1"]),
])
def test_bad_mix_flags_are_one_line(flag, value, words, tmp_path):
    result = run_in_process("train", "--data", "synthetic", flag, value, "--out", tmp_path)
    one_line_error(result, *words)


def test_mixing_refuses_dense_targets():
    from tandem.config import TrainConfig
    from tandem.errors import UsageError
    from tandem.train.build import mixing_of

    class Masks:
        target_shape = (4, 4)
    cfg = TrainConfig.from_settings({"mixup": 0.2, "num_classes": 3})
    with pytest.raises(UsageError, match="class-index targets"):
        mixing_of(cfg, Masks())
    assert mixing_of(TrainConfig.from_settings({"num_classes": 3}), Masks()) is None
    assert math.isclose(mixing_of(cfg, object()).mixup, 0.2)


def test_a_device_decoded_folder_mixes_its_shares_alike(tmp_path):
    """--decode gpu (its device half on the CPU here): the decoded batch keeps its pairing,
    and the shares of 2 ranks mix as the whole batch does."""
    from conftest import make_image_folder

    from tandem.data.device import Normalization
    from tandem.data.device_decode import DeviceDecoded, host_decode

    train, _, _ = load_dataset(str(make_image_folder(tmp_path, per_class=4, size=20)),
                               augment="auto", image_size=16)
    decoded = DeviceDecoded(train, "cpu", host_decode)
    norm = Normalization(train.mean, train.std)

    def batches(world):
        per_rank = [[(norm(x.contiguous()), y, p) for x, y, p in make_loader(
            decoded, 5, shuffle=True, seed=2, epoch=0, rank=r, world_size=world, mix=MIXING)]
            for r in range(world)]
        return [[p.mix(x, y) for x, y, p in (rank[i] for rank in per_rank)]
                for i in range(len(per_rank[0]))]
    for alone, shared in zip(batches(1), batches(2)):
        assert torch.equal(alone[0][0], torch.cat([s[0] for s in shared]))
        assert torch.equal(alone[0][1], torch.cat([s[1] for s in shared]))


def test_label_smoothing_of_mixed_targets_is_timms():
    """timm's mixup_target smooths each label (off = e / C, on = 1 - e + off) and mixes the
    two; torch's CrossEntropyLoss(label_smoothing=e) on the mixed probabilities is the same
    loss (smoothing is affine)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 5, generator=g, dtype=torch.float64)
    own, partner, lam, e = torch.tensor([0, 1, 4, 2]), torch.tensor([3, 1, 0, 2]), 0.3, 0.1
    off, on = e / 5, 1 - e + e / 5
    def smoothed(labels):
        return torch.nn.functional.one_hot(labels, 5).double() * (on - off) + off
    timm = smoothed(own) * lam + smoothed(partner) * (1 - lam)
    expected = -(timm * logits.log_softmax(1)).sum(1).mean()
    ours = torch.nn.CrossEntropyLoss(label_smoothing=e)(
        logits, soft_targets(own, partner, lam, 5, torch.float64))
    assert torch.allclose(ours, expected, rtol=1e-12, atol=0)
