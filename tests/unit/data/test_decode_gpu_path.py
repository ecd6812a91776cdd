"""`--decode gpu` against the CPU path (`--decode cpu`, today's): the same crop boxes and flips
from the same keys, pixels within stated bounds (decode injected: Pillow on the host, the rest
on the CPU device), the CPU path's fallbacks and substitutes, and the flag's resolution."""

import json
import logging
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import run_in_process, write_measured
from tandem.data import LoaderCache, imagenet_transforms, load_dataset, make_loader
from tandem.data.decode import reduction
from tandem.data import device_decode
from tandem.data.device_decode import (DeviceDecoded, DeviceDecoder, decode_on, host_decode,
                                       nvjpeg_decode, resample, resolve_decode)
from tandem.data.encoded import Encoded, collate_encoded
from tandem.cli.common import error_line
from tandem.errors import UsageError
from tandem.train import build as run_module

from test_decode import photo

# Uneven sizes; at 32 and 64 px most of the large ones decode at 1/2 to 1/8 on the CPU path.
SIZES = [(500, 375), (375, 500), (333, 217), (64, 48), (1001, 799), (20, 13), (257, 256),
         (640, 480)]

# Bounds on |gpu path - CPU path| per pixel, uint8 levels, per crop, with the decode on the
# host (Pillow, libjpeg-turbo: the CPU path's decoder) and the rest on the CPU device, over
# these photos at 32, 64 and 224 px, seeds 0-5 (measured on this 2-core avx2 EPYC):
# - a full-scale crop, and the val crop: both resample with torch's antialiased bilinear
#   (float32 here, the uint8 kernel or Pillow there): measured max 1, worst crop mean 0.21.
# - a crop the CPU path decodes at 1/2, 1/4 or 1/8 (libjpeg's DCT scaling, then Pillow
#   resamples the box), which the gpu path decodes whole and resamples: two low-pass filters,
#   measured max 20 and worst crop mean 2.45 (at 1/8; 1.42 at 1/2).
FULL_MAX, FULL_MEAN = 2, 0.35
REDUCED_MAX, REDUCED_MEAN = 32, 3.5
# On a GPU, nvJPEG decodes (its IDCT and chroma upsampling, not libjpeg-turbo's) and CUDA's
# kernels resample. torchvision's own test allows a mean of 2 levels between its CUDA and CPU
# decodes; these bounds add that to the host-decode ones. Not yet measured on a GPU:
# scripts/gpu_check.sh writes the figures (nvjpeg_pixels.json) for whoever runs it.
GPU_FULL_MAX, GPU_FULL_MEAN = 48, FULL_MEAN + 2
GPU_REDUCED_MAX, GPU_REDUCED_MEAN = 64, REDUCED_MEAN + 2


pytestmark = pytest.mark.usefixtures("fresh_imagefolder_warnings")


def photo_tree(root, sizes):
    """``root/{train,val}/c{0,1}/{i}.jpg``: textured photos of ``sizes[i]``, quality 90."""
    for split in ("train", "val"):
        for c in range(2):
            d = root / split / f"c{c}"
            d.mkdir(parents=True)
            for i, (w, h) in enumerate(sizes):
                photo(w, h, i + 10 * c).save(d / f"{i}.jpg", quality=90)
    return root


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return photo_tree(tmp_path_factory.mktemp("photos"), SIZES)


def _sets(root, size):
    train, val, _ = load_dataset(str(root), augment="imagenet", image_size=size)
    return train, val


def _on_cpu(dataset):
    return DeviceDecoded(dataset, "cpu", host_decode)


def _full_scale(dataset, i: int, sample, size: int) -> bool:
    """Whether the CPU path makes ``sample`` (file ``i``'s crop) from a full-scale decode: a
    val crop (resized whole), or a box that libjpeg's DCT scaling does not reduce."""
    w, h = Image.open(dataset.samples[i][0]).size
    return sample.resize is not None or reduction(w, h, sample.box, size, size) == 1


def worst_against_the_cpu_path(root, sizes, seeds, device, decode):
    """The gpu path (``decode`` on ``device``) against the CPU path on ``root``'s training and
    val crops at ``sizes``, each set's crops of ``seeds`` as one batch: the worst max and mean
    level differences, {"full": [max, mean], "reduced": [...]}, and how many files the decoder
    refused (those the CPU path made: not measured)."""
    worst, refused = {"full": [0.0, 0.0], "reduced": [0.0, 0.0]}, 0
    for size in sizes:
        for dataset in _sets(root, size):
            encoded = DeviceDecoded(dataset, device, decode)
            decoder = DeviceDecoder(encoded, device, decode)
            keys = [(i, seed, 2) for seed in seeds for i in range(len(dataset))]
            samples = [encoded[key] for key in keys]
            images, _ = decoder(*collate_encoded(samples, size=size))
            refused += decoder.refused
            for key, (sample, _), image in zip(keys, samples, images.cpu()):
                diff = (dataset[key][0].int() - image.int()).abs().float()
                kind = worst["full" if _full_scale(dataset, key[0], sample, size) else
                             "reduced"]
                kind[0] = max(kind[0], diff.max().item())
                kind[1] = max(kind[1], diff.mean().item())
    return worst, refused


def _one(dataset, key) -> torch.Tensor:
    """The gpu path's ``(3, S, S)`` crop of sample ``key``, made alone."""
    sample, label = dataset[key]
    batch, labels = collate_encoded([(sample, label)], size=dataset.image_size)
    return DeviceDecoder(dataset, "cpu", host_decode)(batch, labels)[0][0]


@pytest.mark.parametrize("size", [32, 64, 224])
@pytest.mark.parametrize("seed", [0, 7, 1234])
def test_train_boxes_and_flips_are_the_cpu_paths(folder, monkeypatch, size, seed):
    """The box and flip the CPU path hands its decoder (spied on), for every training key."""
    train, _ = _sets(folder, size)
    encoded = _on_cpu(train)
    used = []
    real = imagenet_transforms.decode_crop
    monkeypatch.setattr(imagenet_transforms, "decode_crop",
                        lambda img, box, size, flip: used.append((box, flip)) or
                        real(img, box, size, flip))
    scales, flips = set(), set()
    for epoch in (0, 3):
        for i in range(len(train)):
            used.clear()
            train[(i, seed, epoch)]
            sample = encoded[(i, seed, epoch)][0]
            assert isinstance(sample, Encoded) and sample.resize is None
            assert used == [(sample.box, sample.flip)], (i, seed, epoch)
            w, h = Image.open(train.samples[i][0]).size
            scales.add(reduction(w, h, sample.box, size, size))
            flips.add(sample.flip)
    assert flips == {False, True}
    assert size == 224 or scales > {1}  # the reduced-scale decode was among them


@pytest.mark.parametrize("size", [32, 224])
def test_val_resize_and_box_are_the_cpu_paths(folder, monkeypatch, size):
    """The whole image's new size and the centre box Pillow is asked for (spied on)."""
    _, val = _sets(folder, size)
    calls = []
    resize, crop = Image.Image.resize, Image.Image.crop
    monkeypatch.setattr(Image.Image, "resize",
                        lambda img, to, *a, **k: calls.append(tuple(to)) or resize(img, to, *a, **k))
    monkeypatch.setattr(Image.Image, "crop",
                        lambda img, box=None: calls.append(tuple(box)) or crop(img, box))
    for i in range(len(val)):
        calls.clear()
        val[(i, 5, 1)]
        sample = _on_cpu(val)[(i, 5, 1)][0]
        assert calls == [sample.resize, sample.box] and not sample.flip, i


@pytest.mark.parametrize("size", [32, 64, 224])
def test_pixels_agree_with_the_cpu_path_within_the_stated_bounds(folder, size):
    """Each crop alone, then whole batches through make_loader: the same labels, the pixels
    within the bounds above (full-scale and val crops; reduced-scale ones)."""
    train, val = _sets(folder, size)
    reduced = 0
    for dataset in (train, val):
        encoded = _on_cpu(dataset)
        for seed in range(3):
            for i in range(len(dataset)):
                key = (i, seed, 2)
                sample = encoded[key][0]
                full = _full_scale(dataset, i, sample, size)
                reduced += not full
                diff = (dataset[key][0].int() - _one(encoded, key).int()).abs().float()
                bound_max, bound_mean = (FULL_MAX, FULL_MEAN) if full else \
                    (REDUCED_MAX, REDUCED_MEAN)
                assert diff.max() <= bound_max and diff.mean() <= bound_mean, \
                    (dataset.augment, key, diff.max().item(), diff.mean().item())
            cpu = next(iter(make_loader(dataset, 16, shuffle=True, seed=seed, epoch=1)))
            gpu = next(iter(make_loader(encoded, 16, shuffle=True, seed=seed, epoch=1)))
            assert torch.equal(cpu[1], gpu[1]) and gpu[0].dtype == torch.uint8
            assert (cpu[0].int() - gpu[0].int()).abs().max() <= REDUCED_MAX
    assert size == 224 or reduced


def test_a_worker_sends_the_same_batches_and_an_empty_share_is_empty(folder):
    """Through a worker process (the batch pickled), resumed by LoaderCache, and a rank whose
    share of the last batch is empty."""
    train, _ = _sets(folder, 32)
    encoded = _on_cpu(train)
    inline = list(make_loader(encoded, 6, shuffle=True, seed=1, epoch=0))
    cache = LoaderCache()
    in_worker = list(cache.get(encoded, 6, shuffle=True, seed=1, epoch=0, workers=1))
    assert len(inline) == len(in_worker) == 3
    for (a, la), (b, lb) in zip(inline, in_worker):
        assert torch.equal(a, b) and torch.equal(la, lb)
    moved = list(cache.get(encoded, 6, shuffle=True, seed=1, epoch=0, start_batch=2, workers=1))
    assert len(moved) == 1 and torch.equal(moved[0][0], inline[2][0])
    # 16 samples, batch 6: the last global batch has 4, and rank 4 of 5 gets none of it
    last = list(make_loader(encoded, 6, shuffle=True, seed=1, epoch=0, rank=4, world_size=5))
    assert last[-1][0].shape == (0, 3, 32, 32) and last[-1][1].shape == (0,)


def _odd_files(root):
    """In train/c0: a PNG, a CMYK JPEG, a file that is no image, a JPEG cut short (each of
    these two followed by a PNG, their substitute), and one cut short with its end marker put
    back (its header and end pass the worker's checks). Their indices by name."""
    d = root / "train" / "c0"
    photo(90, 70, 1).save(d / "a.png")
    photo(90, 70, 2).convert("CMYK").save(d / "b.jpg", quality=90)
    (d / "c.jpg").write_bytes(b"\x00 not a JPEG at all" * 20)
    photo(90, 70, 5).save(d / "c2.png")
    photo(90, 70, 3).save(d / "d.jpg", quality=90)
    photo(90, 70, 6).save(d / "d2.png")
    data = (d / "d.jpg").read_bytes()
    (d / "d.jpg").write_bytes(data[: len(data) // 2])
    photo(90, 70, 4).save(d / "e.jpg", quality=90)
    data = (d / "e.jpg").read_bytes()
    (d / "e.jpg").write_bytes(data[: len(data) // 2] + b"\xff\xd9")
    samples = load_dataset(str(root), augment="imagenet", image_size=24)[0].samples
    return {Path(p).name: i for i, (p, _) in enumerate(samples) if Path(p).parent == d}


def test_png_cmyk_and_corrupt_files_take_the_cpu_path_with_its_warning(tmp_path, caplog):
    """Each odd file's sample is made in the worker by the CPU path, bit for bit: PNG and CMYK
    decoded there, the unreadable ones warned about and replaced by the next file."""
    root = photo_tree(tmp_path / "photos", [(80, 60)] * 2)
    where = _odd_files(root)
    train, _ = _sets(root, 24)
    encoded = _on_cpu(train)
    with caplog.at_level(logging.WARNING, logger="tandem.data"):
        for name in ("a.png", "b.jpg", "c.jpg", "d.jpg"):
            key = (where[name], 3, 0)
            sample, label = encoded[key]
            assert isinstance(sample, torch.Tensor), name
            cpu, cpu_label = train[key]
            assert torch.equal(sample, cpu) and label == cpu_label, name
    warned = [r.getMessage() for r in caplog.records if "unreadable" in r.getMessage()]
    assert len(warned) == 2 and "c.jpg" in warned[0] + warned[1] and \
        "d.jpg" in warned[0] + warned[1], warned
    assert encoded._bad == {where["c.jpg"], where["d.jpg"]}
    sample = encoded[(where["e.jpg"], 3, 0)][0]
    assert isinstance(sample, Encoded)  # only a decode finds it out
    standard, _, _ = load_dataset(str(root), augment="standard", image_size=24)
    for i in range(len(standard)):  # --augment standard: the CPU path for every file
        assert torch.equal(_on_cpu(standard)[(i, 3, 0)][0], standard[(i, 3, 0)][0])


def test_the_data_set_and_a_batch_survive_pickling(folder):
    """What a spawned worker gets (the data set) and sends back (the batch)."""
    train, _ = _sets(folder, 32)
    encoded = pickle.loads(pickle.dumps(_on_cpu(train)))
    assert encoded.image_size == 32 and len(encoded) == len(train)
    samples = [encoded[(i, 0, 0)] for i in range(4)]
    batch, labels = pickle.loads(pickle.dumps(collate_encoded(samples, size=32)))
    images, _ = DeviceDecoder(encoded, "cpu", host_decode)(batch, labels)
    assert torch.equal(images, torch.stack([_one(encoded, (i, 0, 0)) for i in range(4)]))


def test_a_file_the_device_refuses_is_made_by_the_cpu_path_in_this_process(tmp_path, caplog):
    """The injected decode refuses two files in the batch (a batch decode that fails, then
    one by one): a good one comes from the CPU path bit for bit; the cut one with an end
    marker, which the CPU decoders refuse too, is warned about and replaced by the next file
    with the sample's draws, and the batch's label is the substitute's."""
    root = tmp_path / "photos"
    for c in range(2):
        for split in ("train", "val"):
            (root / split / f"c{c}").mkdir(parents=True, exist_ok=True)
            photo(80, 60, c).save(root / split / f"c{c}" / "0.jpg", quality=90)
    where = _odd_files(root)
    train, _ = _sets(root, 24)
    refused = {(root / "train" / "c0" / n).read_bytes() for n in ("0.jpg", "e.jpg")}
    calls = []

    def picky(files, device):
        calls.append(len(files))
        if any(f.numpy().tobytes() in refused for f in files):
            raise RuntimeError("nvjpeg refused it")
        return host_decode(files, device)

    encoded = DeviceDecoded(train, "cpu", picky)
    keys = [(where["0.jpg"], 4, 1), (where["e.jpg"], 4, 1), (where["a.png"], 4, 1)]
    batch, labels = collate_encoded([encoded[k] for k in keys], size=24)
    with caplog.at_level(logging.WARNING, logger="tandem.data"):
        images, labels = DeviceDecoder(encoded, "cpu", picky)(batch, labels)
    assert calls == [2, 1, 1]  # the PNG was the worker's; the batch call, then one by one
    for j, key in enumerate(keys):
        cpu, label = train[key]  # e.jpg: the CPU path's substitute, with key's draws
        assert torch.equal(images[j], cpu) and labels[j] == label, key
    assert train.samples[where["e.jpg"] + 1][1] == labels[1]
    warned = [r.getMessage() for r in caplog.records if "unreadable" in r.getMessage()]
    assert len(warned) == 1 and "e.jpg" in warned[0]


@pytest.mark.parametrize("fault", [
    torch.OutOfMemoryError("the device's own failure"),
    torch.AcceleratorError("the device's own failure"),
    # torchvision's own wording (decode_jpegs_cuda.cpp): torch's allocator, nvJPEG's
    # allocator (status 5) and execution (6), the stream, the decoder, the build
    RuntimeError("Error while decoding JPEG images: CUDA out of memory. Tried to allocate "
                 "2.00 MiB (the device's own failure)"),
    RuntimeError("Error while decoding JPEG images: Failed to decode batch: 5 (the device's "
                 "own failure)"),
    RuntimeError("Error while decoding JPEG images: Failed to decode jpeg stream: 6 (the "
                 "device's own failure)"),
    RuntimeError("Error while decoding JPEG images: Failed to synchronize CUDA stream: 700 "
                 "(the device's own failure)"),
    RuntimeError("Failed to initialize nvjpeg with hardware backend: 8 (the device's own "
                 "failure)"),
    RuntimeError("decode_jpegs_cuda: torchvision not compiled with nvJPEG support (the "
                 "device's own failure)")],
    ids=["oom", "accelerator", "wrapped-oom", "nvjpeg-allocator", "nvjpeg-execution",
         "stream", "decoder", "build"])
def test_a_device_fault_in_the_decode_is_raised_not_taken_for_bad_files(folder, fault):
    """Out of memory, a CUDA error, or a torchvision that cannot decode at all is the
    device's, not a file's: raised at once, with no file-by-file retry and no quiet fall back
    to the CPU path."""
    train, _ = _sets(folder, 32)
    calls = []

    def faulty(files, device):
        calls.append(len(files))
        raise fault

    encoded = DeviceDecoded(train, "cpu", faulty)
    jpegs = [k for k in range(len(train.samples)) if str(train.samples[k][0]).endswith(".jpg")]
    batch, labels = collate_encoded([encoded[(k, 4, 1)] for k in jpegs[:3]], size=32)
    with pytest.raises(type(fault), match="own failure"):
        DeviceDecoder(encoded, "cpu", faulty)(batch, labels)
    assert calls == [3]


def test_refused_files_are_counted_and_warned_about_once(folder, caplog):
    """A device that refuses files (not a fault) gets them made on the CPU path, counted,
    and said once, with the reason: never a silent switch to CPU decoding."""
    train, _ = _sets(folder, 32)

    def refusing(files, device):  # nvJPEG's status 3, a bad JPEG: the file's
        raise RuntimeError("Error while decoding JPEG images: Failed to get image info: 3")

    encoded = DeviceDecoded(train, "cpu", refusing)
    jpegs = [k for k in range(len(train.samples)) if str(train.samples[k][0]).endswith(".jpg")]
    decoder = DeviceDecoder(encoded, "cpu", refusing)
    with caplog.at_level(logging.WARNING, logger="tandem.data"):
        for batch in (jpegs[:3], jpegs[3:5]):
            decoder(*collate_encoded([encoded[(k, 4, 1)] for k in batch], size=32))
    assert decoder.refused == 5
    warned = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(warned) == 1 and "Failed to get image info: 3" in warned[0], warned


@pytest.mark.parametrize("mode", ["gpu", "auto"])
def test_a_decode_that_cannot_run_is_found_before_the_run(folder, monkeypatch, mode, caplog):
    """A torchvision that cannot decode on the device (built without nvJPEG) is found by a
    probe when the run starts: `gpu` is refused in one line, `auto` decodes on the CPU and
    says why; a decode that works wraps the data sets."""
    monkeypatch.setattr(device_decode, "resolve_decode", lambda mode, device: ("gpu", None))
    data = (*_sets(folder, 32), "info")

    def broken(files, device):
        raise RuntimeError("decode_jpegs_cuda: torchvision not compiled with nvJPEG support")

    with caplog.at_level(logging.INFO, logger="tandem.data"):
        if mode == "gpu":
            with pytest.raises(UsageError, match=r"^decode gpu: torchvision could not decode "
                                                 r"a JPEG on cpu \(.*nvJPEG support\); use "
                                                 r"decode cpu$"):
                device_decode.decode_on(data, mode, torch.device("cpu"), broken)
        else:
            assert device_decode.decode_on(data, mode, torch.device("cpu"), broken) is data
            said = [r.getMessage() for r in caplog.records]
            assert any(m.startswith("--decode auto: JPEGs decoded on the CPU (") and
                       "): torchvision could not" in m for m in said), said
    wrapped = device_decode.decode_on(data, mode, torch.device("cpu"), host_decode)
    assert all(isinstance(d, DeviceDecoded) for d in wrapped[:2])
    # data sets of no JPEG files (synthetic, CIFAR): nothing probed, nothing said
    caplog.clear()
    plain = (torch.utils.data.TensorDataset(torch.zeros(2)), None, "info")
    assert device_decode.decode_on(plain, mode, torch.device("cpu"), broken) is plain
    assert not caplog.records


def test_decode_resolves_to_the_cpu_without_cuda_and_says_what_gpu_needs(monkeypatch):
    assert resolve_decode("cpu", torch.device("cuda")) == ("cpu", None)
    assert resolve_decode("auto", torch.device("cpu")) == ("cpu", None)
    with pytest.raises(UsageError, match=r"^decode gpu needs a CUDA device, and this run's "
                                         r"is cpu \(use decode cpu or auto\)$") as caught:
        resolve_decode("gpu", torch.device("cpu"))
    assert error_line(caught.value) == ("--decode gpu needs a CUDA device, and this run's is "
                                        "cpu (use --decode cpu or auto)")  # the CLI's words
    found = {"torchvision": None}
    monkeypatch.setattr("importlib.util.find_spec", lambda name: found.get(name, "spec"))
    choice, notice = resolve_decode("auto", torch.device("cuda"))
    assert choice == "cpu" and "\n" not in notice and "torchvision" in notice
    with pytest.raises(UsageError, match="^decode gpu needs torchvision"):
        resolve_decode("gpu", torch.device("cuda:0"))
    found.clear()
    assert resolve_decode("auto", torch.device("cuda")) == ("gpu", None)
    data = (object(), object(), None)
    assert decode_on(data, "auto", torch.device("cpu")) is data


def test_decode_gpu_on_this_cpu_machine_is_one_line_from_train_and_eval(folder, tmp_path):
    common = ("--data", folder, "--image-size", "16", "-a", "cifar_resnet20", "-b", "8")
    done = run_in_process("train", *common, "--epochs", "1", "--max-steps", "1",
                          "--no-progress", "--decode", "gpu", "--out", tmp_path / "run")
    assert done.returncode == 2 and done.stderr.strip() == \
        "tandem: error: --decode gpu needs a CUDA device, and this run's is cpu (use " \
        "--decode cpu or auto)", done.stderr
    assert not (tmp_path / "run").exists()


def test_decode_auto_on_the_cpu_is_the_cpu_run_bit_for_bit(folder, tmp_path):
    """Default (auto) and --decode cpu: the same weights and metrics; config.json records it."""
    common = ("--data", folder, "--image-size", "16", "-a", "cifar_resnet20", "-b", "8",
              "--epochs", "1", "--max-steps", "2", "--no-progress", "--seed", "3")
    runs = {}
    for mode in ("auto", "cpu"):
        extra = () if mode == "auto" else ("--decode", "cpu")
        done = run_in_process("train", *common, *extra, "--out", tmp_path / mode)
        assert done.returncode == 0, done.stderr
        config = json.loads((tmp_path / mode / "config.json").read_text())
        assert config["data"]["decode"] == mode
        runs[mode] = torch.load(tmp_path / mode / "checkpoint.pt", weights_only=True)
    a, b = (runs[m]["state_dict"] for m in ("auto", "cpu"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    done = run_in_process("eval", "--resume", tmp_path / "auto", "--decode", "gpu")
    assert done.returncode == 2 and done.stderr.strip().startswith(
        "tandem: error: --decode gpu needs a CUDA device"), done.stderr


def test_train_and_eval_run_the_gpu_path_on_the_cpu_device_with_a_worker(folder, tmp_path,
                                                                           monkeypatch):
    """The whole `tandem train` loop, train and val, and `tandem eval`, fed by the gpu path
    (decode injected, the device half on the CPU, `-j 1`): near the CPU path's figures. At
    32 px most training crops are reduced-scale ones (see the bounds): two steps' train loss
    measured 3.180 (cpu) and 3.200 (gpu); the same weights' val loss (val crops within 1
    level) 1.9382 (cpu) and 1.9387 (gpu)."""
    def on_cpu(data, mode, device, say=True):
        train, val, info = data
        return _on_cpu(train), _on_cpu(val), info

    common = ("--data", folder, "--image-size", "32", "-a", "cifar_resnet20", "-b", "8",
              "--epochs", "1", "--no-progress", "--seed", "3", "-j", "1")
    val = {}
    for mode in ("cpu", "gpu"):
        if mode == "gpu":
            monkeypatch.setattr(run_module, "decode_on", on_cpu)
        done = run_in_process("train", *common, "--out", tmp_path / mode)
        assert done.returncode == 0, done.stderr
        done = run_in_process("eval", "--resume", tmp_path / "cpu", "-j", "1", "--json")
        assert done.returncode == 0, done.stderr
        val[mode] = json.loads(done.stdout)["loss"]
    rows = {m: json.loads((tmp_path / m / "metrics.jsonl").read_text().splitlines()[-1])
            for m in ("cpu", "gpu")}
    assert np.isfinite(rows["gpu"]["val_loss"])
    assert abs(rows["gpu"]["train_loss"] - rows["cpu"]["train_loss"]) < 0.1, rows
    assert abs(val["gpu"] - val["cpu"]) < 0.01, val


def _textured(height: int, width: int) -> torch.Tensor:
    """A (3, H, W) uint8 photo stand-in: a smooth pattern plus noise."""
    g = torch.Generator().manual_seed(0)
    yy, xx = torch.meshgrid(torch.linspace(0, 1, height), torch.linspace(0, 1, width),
                            indexing="ij")
    base = 127 + 100 * torch.sin(20 * xx) * torch.cos(15 * yy)
    noise = torch.randn(3, height, width, generator=g) * 30
    return (base + noise).clamp(0, 255).to(torch.uint8)


def _antialiased(image: torch.Tensor, size: int) -> torch.Tensor:
    out = torch.nn.functional.interpolate(image[None].float(), size=(size, size),
                                          mode="bilinear", antialias=True)
    return out[0].round().clamp(0, 255).to(torch.uint8)


@pytest.mark.parametrize("size", [16, 32, 64])
def test_a_photo_many_times_the_size_is_block_averaged_first(monkeypatch, size):
    """CUDA's antialiased resize refuses a downscale past about 90x (a 4000 px photo to 32):
    past MAX_AA_SCALE the block average comes first, and the result stays within 1 level of
    the one-pass resize (which the CPU can do)."""
    image, seen = _textured(3000, 4000), []
    real = device_decode.F.interpolate

    def interpolate(x, size, **kwargs):
        seen.append(max(x.shape[-2] / size[0], x.shape[-1] / size[1]))
        return real(x, size=size, **kwargs)

    monkeypatch.setattr(device_decode.F, "interpolate", interpolate)
    out = resample(image, size, size)
    monkeypatch.undo()
    assert seen and max(seen) <= device_decode.MAX_AA_SCALE, seen
    assert (out.int() - _antialiased(image, size).int()).abs().max() <= 1
    assert torch.equal(resample(image[:, :640, :480], 32, 32),
                       _antialiased(image[:, :640, :480], 32))  # under the bound: one pass


@pytest.mark.cuda
def test_a_large_downscale_on_cuda_runs_and_matches_the_cpu():
    image = _textured(3000, 4000)
    out = resample(image.cuda(), 32, 32).cpu()
    assert (out.int() - resample(image, 32, 32).int()).abs().max() <= 1


@pytest.mark.cuda
def test_nvjpeg_on_cuda_is_within_the_gpu_bounds_of_the_cpu_path(folder):
    """nvJPEG and CUDA's resampling against the CPU path, per crop, at 32, 64 and 224 px,
    seeds 0-2, training and val crops; the worst figures are written down (gpu_check)."""
    pytest.importorskip("torchvision")
    device = torch.device("cuda")
    worst, refused = worst_against_the_cpu_path(folder, (32, 64, 224), range(3), device,
                                                nvjpeg_decode)
    figures = {"device": torch.cuda.get_device_name(device), "worst_max_and_mean": worst,
               "refused": refused}
    write_measured("nvjpeg_pixels", figures)
    assert figures["refused"] == 0, figures  # else the CPU path made them: nothing measured
    assert worst["full"][0] <= GPU_FULL_MAX and worst["full"][1] <= GPU_FULL_MEAN, figures
    assert worst["reduced"][0] <= GPU_REDUCED_MAX and \
        worst["reduced"][1] <= GPU_REDUCED_MEAN, figures


@pytest.mark.cuda
def test_train_and_eval_with_decode_gpu_on_cuda_come_near_decode_cpu(folder, tmp_path):
    """`tandem train --decode gpu` on CUDA with a worker, against `--decode cpu`: both finish,
    config.json says which, and the figures are near (crops differ by the bounds above)."""
    pytest.importorskip("torchvision")
    common = ("--data", folder, "--image-size", "32", "-a", "cifar_resnet20", "-b", "8",
              "--epochs", "1", "--no-progress", "--seed", "3", "-j", "1", "--devices", "cuda")
    rows = {}
    for mode in ("cpu", "gpu"):
        done = run_in_process("train", *common, "--decode", mode, "--out", tmp_path / mode)
        assert done.returncode == 0, done.stderr
        assert json.loads((tmp_path / mode / "config.json").read_text())["data"]["decode"] \
            == mode
        rows[mode] = json.loads((tmp_path / mode / "metrics.jsonl").read_text()
                                .splitlines()[-1])
        done = run_in_process("eval", "--resume", tmp_path / mode, "-j", "1", "--json",
                              "--decode", mode)
        assert done.returncode == 0, done.stderr
        assert np.isfinite(json.loads(done.stdout)["loss"])
    assert np.isfinite(rows["gpu"]["val_loss"]) and np.isfinite(rows["gpu"]["train_loss"])
    assert abs(rows["gpu"]["train_loss"] - rows["cpu"]["train_loss"]) < 0.2, rows
