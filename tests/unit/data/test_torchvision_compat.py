"""Against the real torchvision, where it is installed (never in CI: it is no CPU dependency;
scripts/gpu_check.sh runs these on the GPU machine, and the README gives a CPU venv that has
it): the zoo's layout and outputs against torchvision's models through ``--pretrained``, the
ImageNet crops against torchvision's transforms, and the ``--decode gpu`` glue with
torchvision's own ``decode_jpeg`` on the CPU device."""

import random

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from tandem.data.device_decode import is_device_fault, nvjpeg_decode
from tandem.data.imagenet_transforms import resized_crop, val_crop, val_resize
from tandem.models import create_model, list_models
from tandem.pretrained import load_pretrained

from test_decode import photo
from test_decode_gpu_path import (FULL_MAX, FULL_MEAN, REDUCED_MAX, REDUCED_MEAN, SIZES,
                                  photo_tree, worst_against_the_cpu_path)

torchvision = pytest.importorskip("torchvision")
pytestmark = pytest.mark.torchvision

# every zoo model torchvision has too (14: AlexNet, the VGGs and the ImageNet ResNets)
LAYOUTS = [name for name in list_models() if hasattr(torchvision.models, name)]


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_zoo_has_torchvisions_state_dict_keys_and_shapes(name):
    with torch.device("meta"):  # no weights made: the layout alone
        theirs = getattr(torchvision.models, name)(weights=None).state_dict()
        ours = create_model(name).state_dict()
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}


def _their_model(name: str) -> nn.Module:
    """torchvision's ``name`` with batch norms that matter in eval (stats and affine drawn)."""
    model = getattr(torchvision.models, name)(weights=None).eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    return model


@pytest.mark.parametrize("name", ["alexnet", "resnet18", "resnet50", "vgg11_bn"])
def test_torchvision_weights_through_pretrained_give_torchvisions_outputs(name, tmp_path):
    """Saved as torchvision publishes them (a bare state dict), loaded by ``--pretrained``.
    Noise floor: torchvision's own outputs at another thread count. Negative control: one
    first-layer weight moved by 1e-3 must exceed the bound."""
    theirs = _their_model(name)
    torch.save(theirs.state_dict(), tmp_path / "w.pth")
    ours = create_model(name).eval()
    assert "pretrained" in load_pretrained(ours, str(tmp_path / "w.pth"), name)
    x = torch.randn(2, 3, 64, 64)
    threads = torch.get_num_threads()
    with torch.no_grad():
        expected, got = theirs(x), ours(x)
        torch.set_num_threads(1 if threads > 1 else 2)
        try:
            floor = (theirs(x) - expected).abs().max().item()
        finally:
            torch.set_num_threads(threads)
        bound = 4 * floor + 1e-6 * expected.abs().max().item()
        assert (got - expected).abs().max().item() <= bound
        first = next(m for m in ours.modules() if isinstance(m, nn.Conv2d))
        first.weight[0, 0, 0, 0] += 1e-3
        assert (ours(x) - expected).abs().max().item() > bound


@pytest.mark.parametrize("mode", ["RGB", "L", "RGBA", "P"])
def test_the_val_crop_is_torchvisions_resize_and_center_crop_pixel_for_pixel(tmp_path, mode):
    """As the imagenet example loads and transforms a val image (convert to RGB, Resize,
    CenterCrop), at 224, 64 and 32 px, on landscape, portrait, square and tiny images."""
    transforms = torchvision.transforms
    for i, (w, h) in enumerate([(500, 375), (375, 500), (333, 217), (64, 48), (1001, 799),
                                (257, 256), (224, 224), (300, 1000)]):
        path = tmp_path / f"{i}.{'jpg' if mode in ('RGB', 'L') else 'png'}"
        photo(w, h, i).convert(mode).save(path)
        for size in (224, 64, 32):
            theirs = transforms.Compose([transforms.Resize(val_resize(size)),
                                         transforms.CenterCrop(size)])
            expected = np.array(theirs(Image.open(path).convert("RGB")))
            assert np.array_equal(val_crop(path, size), expected), (w, h, size)


def test_a_full_scale_training_crop_is_torchvisions_resized_crop_within_one_level():
    """The box and flip given, the CPU path's resample (torch's uint8 antialiased kernel)
    against torchvision's ``resized_crop`` on the PIL image (Pillow's): at most 1 level apart,
    as imagenet_transforms.resized_crop states. Negative control: a box one pixel off."""
    draw = random.Random(0)
    worst = 0
    for i in range(60):
        w, h = draw.choice([(500, 375), (375, 500), (333, 217), (1001, 799)])
        image = photo(w, h, i % 7)
        bw, bh = draw.randint(8, w - 1), draw.randint(8, h - 1)
        left, top = draw.randint(0, w - bw - 1), draw.randint(0, h - bh - 1)
        size, flip = draw.choice([32, 64, 224]), draw.random() < 0.5
        ours = resized_crop(np.array(image), (left, top, left + bw, top + bh), 1, size, flip)
        theirs = torchvision.transforms.functional.resized_crop(
            image, top, left, bh, bw, [size, size], antialias=True)
        if flip:
            theirs = theirs.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        worst = max(worst, np.abs(ours.astype(int) - np.array(theirs).astype(int)).max())
        if i == 0:  # negative control: the box moved by one pixel differs by more
            moved = resized_crop(np.array(image), (left + 1, top, left + 1 + bw, top + bh), 1,
                                 size, flip)
            assert np.abs(moved.astype(int) - np.array(theirs).astype(int)).max() > 1
    assert worst <= 1


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    return photo_tree(tmp_path_factory.mktemp("photos"), SIZES)


@pytest.mark.parametrize("size", [32, 64, 224])
def test_torchvisions_decode_jpeg_runs_the_gpu_path_within_the_cpu_bounds(photos, size):
    """The gpu path's glue with the real ``decode_jpeg`` (a list in, CHW uint8 out) on the CPU
    device, where it decodes with libjpeg-turbo as the CPU path does: the host-decode bounds
    hold, and no file is refused (else the CPU path made it and nothing was checked)."""
    worst, refused = worst_against_the_cpu_path(photos, (size,), range(2), "cpu", nvjpeg_decode)
    assert refused == 0
    assert worst["full"][0] <= FULL_MAX and worst["full"][1] <= FULL_MEAN, worst
    assert worst["reduced"][0] <= REDUCED_MAX and worst["reduced"][1] <= REDUCED_MEAN, worst


def test_what_torchvision_refuses_in_a_file_is_not_taken_for_a_device_fault(tmp_path):
    """torchvision's refusals of a JPEG cut short and of one with no image after its start
    marker read as a file's fault (the gpu path then makes the sample on the CPU path, with
    its warning), not as a device fault, which would stop the run."""
    photo(80, 60, 1).save(tmp_path / "a.jpg", quality=90)
    data = (tmp_path / "a.jpg").read_bytes()
    for bad in (data[: len(data) // 2], b"\xff\xd8" + bytes(300)):
        with pytest.raises(RuntimeError) as refused:
            nvjpeg_decode([torch.frombuffer(bytearray(bad), dtype=torch.uint8)], "cpu")
        assert not is_device_fault(refused.value), refused.value
