"""`--decode gpu`'s side stream against the hazard it is for: nvJPEG writing into memory the
train step's queued kernels still read (tandem.data.decode_stream). On the CPU: the order in
which the decoder waits, decodes and hands the batch over. On CUDA: the hazard itself, with
torchvision's decode on the step's stream as the control."""

import contextlib
import warnings

import pytest
import torch

from tandem.data import load_dataset
from tandem.data.decode_stream import DecodeStream
from tandem.data.device_decode import DeviceDecoded, DeviceDecoder, host_decode, nvjpeg_decode
from tandem.data.encoded import collate_encoded

from test_decode_gpu_path import photo_tree

SIZES = [(500, 375), (375, 500), (640, 480), (333, 250)]


def _folder(root, per_class=4):
    """The training set of a :func:`photo_tree` with ``per_class`` photos of SIZES in turn."""
    photo_tree(root, [SIZES[i % len(SIZES)] for i in range(per_class)])
    return load_dataset(str(root), augment="imagenet", image_size=64)[0]


class Recording:
    """A :class:`DecodeStream` stand-in that writes down what happens, and when."""

    def __init__(self, events):
        self.events = events

    @contextlib.contextmanager
    def decoding(self):
        self.events.append("side stream drained, made current")
        yield
        self.events.append("current stream back")

    def hand_over(self, images):
        self.events.append(f"handed over {tuple(images.shape)}")
        return images


def test_the_decode_and_crops_run_inside_the_side_stream_and_the_batch_is_handed_over(
        tmp_path):
    train = _folder(tmp_path / "photos")
    events = []

    def decode(files, device):
        events.append(f"decoded {len(files)}")
        return host_decode(files, device)

    encoded = DeviceDecoded(train, "cpu", decode)
    batch, labels = collate_encoded([encoded[(i, 0, 0)] for i in range(5)], size=64)
    images, _ = DeviceDecoder(encoded, "cpu", decode, stream=Recording(events))(batch, labels)
    assert events == ["side stream drained, made current", "decoded 5", "current stream back",
                      "handed over (5, 3, 64, 64)"]
    plain, _ = DeviceDecoder(encoded, "cpu", host_decode)(batch, labels)  # the CPU: inline
    assert torch.equal(images, plain)


def test_on_a_device_other_than_cuda_nothing_changes_streams():
    stream = DecodeStream(torch.device("cpu"))
    assert stream.stream is None
    with stream.decoding():
        t = torch.ones(3)
    assert stream.hand_over(t) is t


def _corrupted_rounds(decode, device, sizes, rounds: int) -> int:
    """Rounds (of ``rounds``) in which queued reads of freed tensors saw other bytes: each
    round fills tensors of the decoded images' sizes, queues long work and then a sum of each
    on the current stream, frees them while the sums wait, and calls ``decode``."""
    wrong = 0
    spin = torch.randn(4096, 4096, device=device)
    for r in range(rounds):
        victims = [torch.full((3, h, w), 7 + (r + j) % 100, dtype=torch.uint8, device=device)
                   for j, (w, h) in enumerate(sizes)]
        expected = torch.tensor([v.numel() * int(v[0, 0, 0]) for v in victims])
        torch.cuda.synchronize(device)
        x = spin
        for _ in range(12):  # tens of milliseconds queued ahead of the sums
            x = x @ spin
        sums = torch.stack([v.sum(dtype=torch.int64) for v in victims])
        del victims
        decode()
        torch.cuda.synchronize(device)
        wrong += int(not torch.equal(sums.cpu(), expected))
    return wrong


@pytest.mark.cuda
def test_the_gpu_decode_never_writes_into_memory_the_step_still_reads(tmp_path):
    """tandem's DeviceDecoder (side stream) beside torchvision's decode on the step's stream
    (the control: it corrupts the queued reads on an H100; on GPUs where it does not, the
    test says so in a warning and still checks tandem's)."""
    pytest.importorskip("torchvision")
    device = torch.device("cuda", torch.cuda.current_device())
    train = _folder(tmp_path / "photos", per_class=8)
    encoded = DeviceDecoded(train, device)
    batch, labels = collate_encoded([encoded[(i, 0, 0)] for i in range(len(train))], size=64)
    files = batch.files()
    sizes = [SIZES[i % len(SIZES)] for i in range(8)] * 2
    ours = DeviceDecoder(encoded, device)
    tandem_wrong = _corrupted_rounds(lambda: ours(batch, labels.clone()), device, sizes, 30)
    raw_wrong = _corrupted_rounds(lambda: nvjpeg_decode(files, device), device, sizes, 30)
    if raw_wrong == 0:
        warnings.warn(f"torchvision's decode on the step's stream corrupted no queued read on "
                      f"{torch.cuda.get_device_name(device)} in 30 rounds: the control shows "
                      f"no hazard here")
    assert tandem_wrong == 0, (tandem_wrong, raw_wrong)
