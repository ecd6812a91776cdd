"""The main process's half of ``--decode gpu``: nvJPEG decodes each batch, the device crops it.

torchvision is imported only here. The decode is a parameter (``decode(files, device) ->
images``; the tests pass :func:`host_decode`). A file the device refuses is made by the CPU
path in this process; a fault of the device or the build (out of memory, no nvJPEG) is raised.
"""

from __future__ import annotations

import importlib.util
import io
import logging
import re

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from tandem.errors import UsageError, first_line, param

from .decode import DECODER_ERRORS, default_decoder
from .decode_stream import DecodeStream
from .encoded import EncodedBatch, EncodedFolder, collate_encoded
from .imagefolder import ImageFolderDataset
from .paired import delegating

log = logging.getLogger("tandem.data")

DECODE_MODES = ("auto", "cpu", "gpu")
_EXTRA = "pip install 'tandem[gpu]', torchvision built for this torch"
# the device's state, not a file's (a CUDA error is sticky): raised, never retried
_DEVICE_FAULTS = (torch.OutOfMemoryError, *((torch.AcceleratorError,)
                                            if hasattr(torch, "AcceleratorError") else ()))
# the same in torchvision's RuntimeError text; nvJPEG's status 5 to 8 (allocator, execution,
# architecture, internal) are the device's, 2 to 4 a file's
_DEVICE_FAULT_WORDS = ("out of memory", "CUDA error", "Failed to synchronize CUDA stream",
                       "Failed to initialize nvjpeg", "Failed to create", "nvJPEG support")
_DEVICE_STATUS = re.compile(r"Failed to [^:]*: [5-8]\b")


def is_device_fault(exc: BaseException) -> bool:
    """Whether ``exc``, raised by the device's decode, is the device's or the build's."""
    if isinstance(exc, _DEVICE_FAULTS):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        any(w in text for w in _DEVICE_FAULT_WORDS) or _DEVICE_STATUS.search(text) is not None)


def resolve_decode(mode: str, device: torch.device) -> tuple[str, str | None]:
    """``("gpu" or "cpu", why or None)`` for ``--decode mode`` on ``device``; ``gpu`` without
    CUDA or torchvision is refused."""
    if mode not in DECODE_MODES:
        raise UsageError(f"bad {param('decode')} {mode!r}: choose one of {', '.join(DECODE_MODES)}")
    if mode == "cpu":
        return "cpu", None
    device = torch.device(device)
    if device.type != "cuda":
        if mode == "gpu":
            raise UsageError(f"{param('decode')} gpu needs a CUDA device, and this run's is "
                             f"{device} (use {param('decode')} cpu or auto)")
        return "cpu", None
    if importlib.util.find_spec("torchvision") is None:
        if mode == "gpu":
            raise UsageError(f"{param('decode')} gpu needs torchvision ({_EXTRA}), which is not "
                             f"installed (use {param('decode')} cpu or auto)")
        return "cpu", f"no torchvision for nvJPEG ({_EXTRA})"
    return "gpu", None


def nvjpeg_decode(files: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """``(3, H, W)`` uint8 images on ``device`` of JPEG files, by nvJPEG in one call."""
    from torchvision.io import ImageReadMode, decode_jpeg  # the gpu path's alone

    return list(decode_jpeg(files, mode=ImageReadMode.RGB, device=device))


def host_decode(files: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """:func:`nvjpeg_decode`'s stand-in for the tests: Pillow, then moved to ``device``."""
    images = []
    for data in files:
        with Image.open(io.BytesIO(data.numpy().tobytes())) as img:
            rgb = np.array(img.convert("RGB"))
        images.append(torch.from_numpy(rgb).permute(2, 0, 1).to(device))
    return images


# CUDA's antialiased kernel refuses a downscale past about 90x ("Too much shared memory
# required"): a larger one first averages blocks, leaving at most this factor to it
MAX_AA_SCALE = 32


def resample(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """``(3, h, w)`` uint8 to ``(3, height, width)``: antialiased bilinear in float32 (CUDA's
    kernel takes no uint8), as Pillow's resize."""
    x = image[None].float()
    blocks = (-(-x.shape[-2] // (height * MAX_AA_SCALE)), -(-x.shape[-1] // (width * MAX_AA_SCALE)))
    if blocks != (1, 1):
        x = F.avg_pool2d(x, blocks)
    out = F.interpolate(x, size=(height, width), mode="bilinear", antialias=True,
                        align_corners=False)
    return out[0].round_().clamp_(0, 255).to(torch.uint8)


def crop_resize(image: torch.Tensor, job, size: int) -> torch.Tensor:
    """The crop ``job`` (:class:`~tandem.data.encoded.Encoded`) asks of a decoded image, not
    flipped (the batch is, at once)."""
    if job.resize is not None:
        image = resample(image, job.resize[1], job.resize[0])
    left, top, right, bottom = job.box
    image = image[:, top:bottom, left:right]
    if image.shape[1:] != (size, size):
        image = resample(image, size, size)
    return image


class DeviceDecoder:
    """A worker's :class:`~tandem.data.encoded.EncodedBatch` to ``(N, 3, S, S)`` uint8 on
    ``device`` and the labels, on a side stream (:mod:`.decode_stream`)."""

    def __init__(self, dataset: EncodedFolder, device: torch.device, decode=nvjpeg_decode,
                 stream: DecodeStream | None = None):
        self.dataset, self.device, self.decode = dataset, torch.device(device), decode
        self.stream = DecodeStream(self.device) if stream is None else stream
        self.refused = 0  # files the device refused, made by the CPU path here instead

    def __call__(self, batch: EncodedBatch, labels: torch.Tensor):
        with self.stream.decoding():
            images, labels = self._made(batch, labels)
        return self.stream.hand_over(images), labels

    def _made(self, batch: EncodedBatch, labels: torch.Tensor):
        size, pieces = batch.size, [None] * batch.count
        if batch.crops is not None:  # the worker's own (CPU path): flipped already
            for at, crop in zip(batch.crop_at, batch.crops.to(self.device, non_blocking=True)):
                pieces[at] = crop
        flipped = []
        for (at, _, _, job), image in zip(batch.jobs, self._decoded(batch.files())):
            if isinstance(image, Exception):  # refused here: the CPU path, in this process
                self._refused(image)
                crop, labels[at] = self.dataset.base.decode_key(job.key)
                pieces[at] = torch.from_numpy(crop).permute(2, 0, 1).to(self.device)
                continue
            pieces[at] = crop_resize(image, job, size)
            if job.flip:
                flipped.append(at)
        if not pieces:
            return torch.empty((0, 3, size, size), dtype=torch.uint8, device=self.device), labels
        images = torch.stack(pieces)
        if flipped:
            at = torch.tensor(flipped, device=self.device)
            images[at] = images[at].flip(3)
        return images, labels

    def _refused(self, why: Exception) -> None:
        self.refused += 1
        if self.refused == 1:  # once a run: a photo collection may hold many such files
            log.warning("the device refused a file of a batch on %s (%s); it and any other "
                        "file refused are made by the CPU path in the main process",
                        self.device, first_line(why))

    def _decoded(self, files: list[torch.Tensor]) -> list[torch.Tensor | Exception]:
        """The files decoded in one call; if that fails, one by one, the error in place of
        each refused. A device fault is raised (no retry may hide it)."""
        if not files:
            return []
        refusals = (RuntimeError, *DECODER_ERRORS)
        try:
            return list(self.decode(files, self.device))
        except refusals as exc:
            if is_device_fault(exc):
                raise
        images = []
        for data in files:
            try:
                images.append(self.decode([data], self.device)[0])
            except refusals as exc:
                if is_device_fault(exc):
                    raise
                images.append(exc)
        return images


class DecodingLoader:
    """A DataLoader of encoded batches that yields them decoded on the device."""

    def __init__(self, loader, decoder: DeviceDecoder):
        self.loader, self.decoder = loader, decoder

    def __len__(self) -> int:
        return len(self.loader)

    __getattr__ = delegating("loader")

    def __iter__(self):
        for batch, labels, *rest in self.loader:  # rest: a mixed batch's pairing (.paired)
            yield (*self.decoder(batch, labels), *rest)


class DeviceDecoded(EncodedFolder):
    """An ImageFolder dataset decoded on ``device``: workers send files (:meth:`collate`),
    :meth:`finish_loader` decodes them here."""

    def __init__(self, base, device: torch.device, decode=nvjpeg_decode):
        super().__init__(base)
        self.device, self.decode = torch.device(device), decode

    def collate(self, samples: list):
        return collate_encoded(samples, size=self.base.image_size)

    def finish_loader(self, loader) -> DecodingLoader:
        return DecodingLoader(loader, DeviceDecoder(self, self.device, self.decode))


def decoded_on(*datasets) -> str | None:
    """``"gpu"``, ``"cpu"`` or None (no JPEG files): where ``datasets``' JPEGs are decoded."""
    if any(isinstance(d, DeviceDecoded) for d in datasets):
        return "gpu"
    return "cpu" if any(isinstance(d, ImageFolderDataset) for d in datasets) else None


def _probed(mode: str, device: torch.device, decode) -> tuple[str, str | None]:
    """``resolve_decode``'s gpu, once ``decode`` has decoded a small JPEG on ``device``."""
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 100, 50)).save(buffer, format="JPEG")
    probe = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    try:
        decode([probe], torch.device(device))
    except Exception as exc:  # any failure here is the setup's: there is no user file yet
        why = f"torchvision could not decode a JPEG on {device} ({first_line(exc)})"
        if mode == "gpu":
            raise UsageError(f"{param('decode')} gpu: {why}; use {param('decode')} cpu") from None
        return "cpu", why
    return "gpu", None


def decode_on(data: tuple, mode: str, device: torch.device, decode=nvjpeg_decode,
              say: bool = True) -> tuple:
    """``(train, val, info)`` with its ImageFolder data sets decoded on ``device`` where
    ``mode`` resolves to gpu; ``auto`` logs which decoder and why (unless not ``say``)."""
    train, val, info = data
    choice, why = resolve_decode(mode, device)
    folders = [d for d in (train, val) if isinstance(d, ImageFolderDataset)]
    if choice == "gpu" and folders:  # nothing to probe for data sets of no JPEG files
        choice, why = _probed(mode, device, decode)
    if mode == "auto" and folders and say:
        decoder = folders[0].decoder or default_decoder()
        log.info(f"--decode auto: JPEGs decoded on {device} by nvJPEG (torchvision)"
                 if choice == "gpu" else f"--decode auto: JPEGs decoded on the CPU ({decoder}, "
                 f"in the loader): {why or f'the run runs on {device}, not CUDA'}")
    if choice == "cpu" or not folders:
        return data
    wrap = [DeviceDecoded(d, device, decode) if isinstance(d, ImageFolderDataset) else d
            for d in (train, val)]
    return (*wrap, info)
