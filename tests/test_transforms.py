import numpy as np
import pytest
import torch
from PIL import Image

from tandem.data.transforms import (
    SampleRandom, center_crop_pil, decode, hflip, mix_seed, normalize, random_shift,
    resize_shorter, resize_tensor, to_tensor,
)


def test_sample_random_is_a_pure_function_of_its_key():
    a = [SampleRandom(3, 1, 7).randint(9) for _ in range(3)]
    b = [SampleRandom(3, 1, 7).randint(9) for _ in range(3)]
    assert a == b
    r = SampleRandom(3, 1, 7)
    stream = [r.randint(1000) for _ in range(5)]
    assert len(set(stream)) > 1  # successive draws differ


def test_mix_seed_separates_keys_and_order():
    keys = {(s, e, i) for s in range(3) for e in range(3) for i in range(50)}
    seeds = {mix_seed(*k) for k in keys}
    assert len(seeds) == len(keys)
    assert mix_seed(1, 2) != mix_seed(2, 1)
    assert 0 <= mix_seed(12345, 6, 7) < 2**63


def test_sample_random_is_roughly_uniform():
    counts = np.bincount([SampleRandom(0, 0, i).randint(9) for i in range(9000)], minlength=9)
    assert counts.min() > 800 and counts.max() < 1200
    coins = sum(SampleRandom(1, 2, i).coin() for i in range(4000))
    assert 1800 < coins < 2200


def test_random_shift_moves_content_and_zero_fills():
    img = torch.arange(1, 1 + 2 * 6 * 6, dtype=torch.float32).view(2, 6, 6)
    seen = set()
    for i in range(200):
        rng = SampleRandom(0, 0, i)
        out = random_shift(img, 2, rng)
        assert out.shape == img.shape
        # recover the offset from where pixel (0, 0) of the source landed
        rng = SampleRandom(0, 0, i)
        dy, dx = rng.randint(5), rng.randint(5)
        seen.add((dy, dx))
        sy, sx = 2 - dy, 2 - dx  # output (y, x) shows source (y - sy, x - sx)
        for y in range(6):
            for x in range(6):
                src_y, src_x = y - sy, x - sx
                expect = (img[:, src_y, src_x] if 0 <= src_y < 6 and 0 <= src_x < 6
                          else torch.zeros(2))
                assert torch.equal(out[:, y, x], expect)
    assert len(seen) == 25  # every offset in [-2, 2]^2 is reachable


def test_random_shift_with_no_padding_is_identity():
    img = torch.randn(3, 4, 4)
    assert random_shift(img, 0, SampleRandom(1)) is img


def test_hflip_and_normalize():
    img = torch.arange(6.0).view(1, 2, 3)
    assert hflip(img).tolist() == [[[2, 1, 0], [5, 4, 3]]]
    x = torch.ones(2, 2, 2)
    out = normalize(x, [0.5, 1.0], [0.25, 2.0])
    assert torch.allclose(out[0], torch.full((2, 2), 2.0))
    assert torch.allclose(out[1], torch.zeros(2, 2))
    assert torch.equal(x, torch.ones(2, 2, 2))  # input untouched


def test_pil_pipeline(tmp_path):
    arr = np.zeros((20, 40, 3), dtype=np.uint8)
    arr[:, 20:, 0] = 255  # right half red
    Image.fromarray(arr).save(tmp_path / "a.png")
    img = decode(tmp_path / "a.png")
    assert img.mode == "RGB" and img.size == (40, 20)
    small = resize_shorter(img, 10)
    assert small.size == (20, 10)
    tall = resize_shorter(img.transpose(Image.Transpose.ROTATE_90), 10)
    assert tall.size == (10, 20)
    crop = center_crop_pil(small, 10)
    assert crop.size == (10, 10)
    t = to_tensor(crop)
    assert t.shape == (3, 10, 10) and t.dtype == torch.float32
    assert float(t.max()) == 1.0 and float(t.min()) == 0.0
    assert torch.all(t[0, :, -1] == 1.0) and torch.all(t[0, :, 0] == 0.0)
    gray = to_tensor(Image.fromarray(np.full((3, 3), 51, dtype=np.uint8)))
    assert gray.shape == (1, 3, 3) and torch.allclose(gray, torch.full((1, 3, 3), 0.2))


def test_decode_corrupt_file_raises(tmp_path):
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"not an image")
    with pytest.raises(Exception):
        decode(bad)


def test_resize_tensor():
    img = torch.ones(1, 8, 8)
    assert resize_tensor(img, 8) is img
    out = resize_tensor(img, 16)
    assert out.shape == (1, 16, 16) and torch.allclose(out, torch.ones(1, 16, 16))
