import numpy as np
import torch
from PIL import Image

from tandem.data.transforms import (
    SampleRandom, hflip, mix_seed, random_shift, resize_array, to_array, to_tensor,
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
    img = np.arange(1, 1 + 2 * 6 * 6, dtype=np.float32).reshape(2, 6, 6)
    seen = set()
    for i in range(200):
        out = random_shift(img, 2, SampleRandom(0, 0, i))
        assert out.shape == img.shape
        rng = SampleRandom(0, 0, i)  # replay the draws: output (y, x) shows (y + dy, x + dx)
        dy, dx = rng.randint(5) - 2, rng.randint(5) - 2
        seen.add((dy, dx))
        for y in range(6):
            for x in range(6):
                sy, sx = y + dy, x + dx
                expect = img[:, sy, sx] if 0 <= sy < 6 and 0 <= sx < 6 else np.zeros(2)
                assert np.array_equal(out[:, y, x], expect)
    assert len(seen) == 25  # every offset in [-2, 2]^2 is reachable
    assert img[0, 0, 0] == 1  # the input is never written


def test_random_shift_edge_cases():
    img = np.random.default_rng(0).random((3, 4, 4), dtype=np.float32)
    assert random_shift(img, 0, SampleRandom(1)) is img
    # a shift as large as the image leaves nothing of it (and does not crash)
    outs = [random_shift(img, 4, SampleRandom(0, 0, i)) for i in range(100)]
    assert any(not o.any() for o in outs) and all(o.shape == img.shape for o in outs)


def test_hflip_and_to_tensor():
    img = np.arange(6.0, dtype=np.float32).reshape(1, 2, 3)
    assert hflip(img).tolist() == [[[2, 1, 0], [5, 4, 3]]]
    t = to_tensor(hflip(img))  # negative strides are made contiguous
    assert t.dtype == torch.float32 and t.tolist() == [[[2, 1, 0], [5, 4, 3]]]


def test_pil_images_to_tensors():
    arr = np.zeros((10, 10, 3), dtype=np.uint8)
    arr[:, 5:, 0] = 255  # right half red
    img = Image.fromarray(arr)
    assert to_array(img).dtype == np.float32
    t = to_tensor(img)
    assert t.shape == (3, 10, 10) and t.dtype == torch.float32
    assert float(t.max()) == 1.0 and float(t.min()) == 0.0
    assert torch.all(t[0, :, -1] == 1.0) and torch.all(t[0, :, 0] == 0.0)
    gray = to_tensor(Image.fromarray(np.full((3, 3), 51, dtype=np.uint8)))
    assert gray.shape == (1, 3, 3) and torch.allclose(gray, torch.full((1, 3, 3), 0.2))


def test_resize_array():
    img = np.ones((1, 8, 8), dtype=np.float32)
    assert resize_array(img, 8) is img
    out = resize_array(img, 16)
    assert out.shape == (1, 16, 16) and np.allclose(out, 1.0)
