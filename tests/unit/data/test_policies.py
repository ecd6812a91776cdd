"""RandAugment, TrivialAugment and random erasing against hand-computed cases (each draw given in
order), and against themselves: the same sample gives the same image in loaders of other worker
counts, ranks and shares, on the uint8 path (ImageFolder) and the float one (digits)."""

import math

import numpy as np
import pytest
import torch
from conftest import make_image_folder, one_line_error, run_in_process
from PIL import Image

from tandem.data import load_dataset, make_loader
from tandem.data.dataset import parse_augment
from tandem.data.encoded import EncodedFolder
from tandem.data.erasing import erase_box, erase_normalised, erase_pixels
from tandem.data.policies import RandAugment, TrivialAugment, parse_policy
from tandem.errors import UsageError
from tandem.parallel.shares import shares


class Scripted:
    """A SampleRandom that returns the draws it is given, in order (each checked in range)."""

    def __init__(self, *draws):
        self.draws = list(draws)

    def _pop(self):
        return self.draws.pop(0)

    def randint(self, n: int) -> int:
        value = self._pop()
        assert 0 <= value < n, (value, n)
        return value

    def coin(self) -> bool:
        return bool(self._pop())

    def uniform(self, low: float, high: float) -> float:
        value = self._pop()
        assert low <= value <= high, (value, low, high)
        return value


def test_randaugment_by_hand():
    """Picks 2 (Invert) and 4 (Posterize), both applied (draws 0.3 and 0.5 <= 1/2); at M 9
    posterize keeps int(4 * 9 / 10) = 3 bits: 200 -> 55 -> 32, 37 -> 218 -> 192."""
    policy = RandAugment(2, 9)
    rng = Scripted(2, 4, 0.3, 0.5)
    out = policy.on_uint8(np.array([[[200], [37]]], np.uint8), rng, 128)
    assert out[:, :, 0].tolist() == [[32, 192]] and rng.draws == []
    # a draw above 1/2 leaves the op out: only the second pick (Invert) runs
    assert policy.draw(Scripted(4, 2, 0.51, 0.1)) == [("Invert", 9)]


def test_trivialaugment_by_hand():
    """Solarize at bin 15: threshold 255 (1 - 15/30) = 127.5. TranslateX at bin 15: 16
    pixels, negated (coin 1), bilinear (pick 0): the content moves 16 to the right."""
    policy = TrivialAugment()
    out = policy.on_uint8(np.array([[[100], [128], [200]]], np.uint8), Scripted(11, 15), 0)
    assert out[:, :, 0].tolist() == [[100, 127, 55]]
    row = np.arange(32, dtype=np.uint8).reshape(1, 32, 1)
    out = policy.on_uint8(row, Scripted(3, 15, 1, 0), 7)
    assert out[0, :, 0].tolist() == [7] * 16 + list(range(16))
    assert policy.draw(Scripted(0)) == [("Identity", None)]  # no magnitude drawn


def test_a_float_image_goes_through_uint8_pixels():
    image = np.array([[[0.0, 1.0], [100 / 255, 0.5]]], dtype=np.float32)  # (1, 2, 2)
    out = RandAugment(1, 5).on_float(image, Scripted(2, 0.0), 0)  # Invert
    assert out.dtype == np.float32 and out.shape == (1, 2, 2)
    assert (out * 255).round().tolist() == [[[255, 0], [155, 127]]]  # 0.5 -> 128 -> 127


def test_erase_box_by_hand():
    """Erased (0.4 <= 0.5); the first try, a third of the 8 x 8 image at aspect 10/3, is 8
    high: it does not fit; the second, 16 pixels at aspect 1, is 4 x 4 at (top 1, left 2)."""
    rng = Scripted(0.4, 1 / 3, math.log(1 / 0.3), 0.25, 0.0, 1, 2)
    assert erase_box(8, 8, 0.5, rng) == (1, 2, 4, 4) and rng.draws == []
    assert erase_box(8, 8, 0.5, Scripted(0.6)) is None  # 0.6 > 0.5: not erased
    assert erase_box(8, 8, 0.0, Scripted()) is None


def _noise(key, shape):
    return np.random.Generator(np.random.Philox(key=key)).standard_normal(shape,
                                                                          dtype=np.float32)


def test_erasing_fills_the_box_with_the_normalised_images_noise():
    image = np.ones((2, 6, 6), np.float32)
    out = erase_normalised(image, 1.0, Scripted(0.0, 0.25, 0.0, 0, 1, 7))  # 3 x 3 at (0, 1)
    assert np.array_equal(out[:, 0:3, 1:4], _noise(7, (2, 3, 3)))
    out[:, 0:3, 1:4] = 1
    assert np.array_equal(out, image) and image.min() == 1  # the rest, and the input, untouched


def test_erasing_uint8_pixels_takes_the_noise_back_through_the_normalisation():
    image = np.zeros((6, 6, 3), np.uint8)
    mean, std = (0.5, 0.4, 0.3), (0.25, 0.2, 0.1)
    out = erase_pixels(image, 1.0, Scripted(0.0, 0.25, 0.0, 2, 3, 9), mean, std)
    z = _noise(9, (3, 3, 3)).transpose(1, 2, 0)
    expected = np.clip(np.rint((np.float32(mean) + np.float32(std) * z) * 255), 0, 255)
    assert np.array_equal(out[2:5, 3:6], expected.astype(np.uint8))
    assert out[:2].max() == 0 and out[:, :3].max() == 0 and image.max() == 0


@pytest.mark.parametrize("text, words", [
    ("randaugment:x", "randaugment:N:M"), ("randaugment:0:9", "1 or more"),
    ("randaugment:2:11", "0 to 10"), ("randaugment:2", "randaugment:N:M"),
    ("trivial", "choose one of"), ("trivialaugment:2", "not one of"),
])
def test_bad_policies_are_refused(text, words):
    with pytest.raises(UsageError, match=words):
        parse_augment(text)


def test_policies_parse_and_compare():
    assert parse_policy("randaugment:2:9") == RandAugment(2, 9.0)
    assert parse_augment("trivialaugment", 0.25).geometry == "auto"
    assert parse_augment("standard").policy is None


def test_cli_says_a_bad_augment_and_reprob_in_one_line(tmp_path):
    one_line_error(run_in_process("train", "--augment", "randaugment:x", "--out", tmp_path),
                   "bad --augment 'randaugment:x'")
    one_line_error(run_in_process("train", "--reprob", "2", "--out", tmp_path), "bad --reprob 2")
    one_line_error(run_in_process("train", "--data", "synthetic", "--augment", "trivialaugment",
                                  "--out", tmp_path), "synthetic data is noise")


def _images_in_order(train, world, workers, weights=None, batch=7):
    """Every sample of epoch 1 as the ranks' loaders give it, joined in rank order."""
    split = None if weights is None else (lambda e, b, n: shares(n, weights))
    per_rank = [[x for x, _ in make_loader(train, batch, shuffle=True, seed=4, epoch=1, rank=r,
                                           world_size=world, workers=workers, split=split)]
                for r in range(world)]
    return torch.cat([torch.cat([rank[i] for rank in per_rank])
                      for i in range(len(per_rank[0]))])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("folder"), per_class=6, size=24)


@pytest.mark.parametrize("augment", ["randaugment:2:9", "trivialaugment"])
def test_a_sample_is_the_same_in_any_loader_uint8(folder, augment):
    train, _, _ = load_dataset(str(folder), augment=augment, image_size=16, reprob=0.5)
    alone = _images_in_order(train, 1, 0)
    assert alone.dtype == torch.uint8 and alone.shape[0] == len(train)
    assert torch.equal(_images_in_order(train, 2, 2), alone)
    assert torch.equal(_images_in_order(train, 3, 1, weights=(3, 1, 1)), alone)
    plain, _, _ = load_dataset(str(folder), augment="auto", image_size=16)
    assert not torch.equal(_images_in_order(plain, 1, 0), alone)  # the policy did something
    # --decode gpu's workers take the CPU path for such a recipe: the same crops
    encoded = EncodedFolder(train)
    assert torch.equal(encoded[(3, 4, 1)][0], train[(3, 4, 1)][0])


def test_a_sample_is_the_same_in_any_loader_float():
    train, _, _ = load_dataset("digits", augment="trivialaugment", reprob=0.5)
    alone = _images_in_order(train, 1, 0, batch=64)
    assert alone.dtype == torch.float32
    assert torch.equal(_images_in_order(train, 2, 2, batch=64), alone)
    assert torch.equal(_images_in_order(train, 3, 0, weights=(1, 2, 1), batch=64), alone)
    plain, _, _ = load_dataset("digits", augment="auto")
    assert not torch.equal(_images_in_order(plain, 1, 0, batch=64), alone)
    assert torch.equal(train[(5, 4, 1)][0], train[(5, 4, 1)][0])
    assert not torch.equal(train[(5, 4, 1)][0], train[(5, 4, 2)][0])  # another epoch


def test_validation_is_never_augmented(folder):
    _, val, _ = load_dataset(str(folder), augment="randaugment:2:9", image_size=16, reprob=1.0)
    _, plain, _ = load_dataset(str(folder), augment="none", image_size=16)
    assert val.policy is None and val.reprob == 0
    assert torch.equal(val[(0, 1, 1)][0], plain[(0, 1, 1)][0])


def test_a_users_data_set_does_its_own_augmentation():
    import tandem

    data = torch.utils.data.TensorDataset(torch.randn(8, 1, 4, 4), torch.randint(0, 2, (8,)))
    with pytest.raises(UsageError, match="its own augmentation"):
        tandem.fit(None, data, augment="randaugment:2:9")
    with pytest.raises(UsageError, match="reprob"):
        tandem.fit(None, data, reprob=0.5)


def test_pil_modes_of_one_and_three_channels():
    grey = np.full((4, 4, 1), 90, np.uint8)
    colour = np.full((4, 4, 3), 90, np.uint8)
    for image, fill in ((grey, 3), (colour, (1, 2, 3))):
        for pick in range(15):  # every RandAugment operation, applied
            out = RandAugment(1, 10).on_uint8(image, Scripted(pick, 0.0, 0, 1), fill)
            assert out.shape == image.shape and out.dtype == np.uint8
    assert Image.fromarray(colour).mode == "RGB"
