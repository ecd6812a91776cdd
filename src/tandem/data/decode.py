"""Image files to ``uint8`` RGB arrays for a training crop: simplejpeg for JPEGs, Pillow otherwise.

A decoder opens the file's bytes, tells its size, and decodes it whole, at the smallest
``1/2^k`` scale (k <= 3) that still leaves the crop box at least the output's size: libjpeg's
DCT scaling, which Pillow calls ``draft``. Both decoders pick the same scale by the same rule
and both wrap libjpeg-turbo, so a JPEG gives the same pixels, or pixels within the tolerance
``tests/test_decode.py`` states, whichever decoded it. simplejpeg (when installed) decodes
straight into a numpy array, without Pillow's RGBX image in between; Pillow remains the decoder
for every other format, for CMYK JPEGs, and for every file when ``decoder="pillow"``.
A file that does not decode raises (ValueError, OSError, ...), naming nothing: the dataset
reports it (see :meth:`~tandem.data.imagefolder.ImageFolderDataset.decode_key`).
"""

from __future__ import annotations

import io
import math

import numpy as np
from PIL import Image, UnidentifiedImageError

try:  # optional at import time; a pyproject dependency, but a plain Pillow install still runs
    import simplejpeg
except ImportError:  # pragma: no cover - exercised where simplejpeg is absent
    simplejpeg = None

__all__ = ["DECODERS", "default_decoder", "read_bytes", "open_pillow", "open_image",
           "reduction", "PillowImage", "SimpleJpegImage"]

DECODERS = ("simplejpeg", "pillow")
_JPEG_MAGIC = b"\xff\xd8\xff"


def default_decoder() -> str:
    """``"simplejpeg"`` when it is importable, else ``"pillow"``."""
    return "simplejpeg" if simplejpeg is not None else "pillow"


def read_bytes(path) -> bytes:
    """The whole file, in one read (a file object is read from where it stands)."""
    if hasattr(path, "read"):
        return path.read()
    with open(path, "rb") as f:
        return f.read()


def open_pillow(data: bytes, path) -> Image.Image:
    """Pillow's image of ``data``, parsed from a buffer and decoded in one call.

    Pillow hands libjpeg the whole file at once instead of 64 KB blocks, so it never suspends
    and resumes mid-scan (about 5% of a JPEG's decode). Not an image: Pillow's
    ``UnidentifiedImageError``, naming ``path`` (not the buffer).
    """
    try:
        img = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise UnidentifiedImageError(f"cannot identify image file '{path}'") from None
    img.decodermaxblock = max(len(data), img.decodermaxblock)  # bytes per decoder call
    return img


def reduction(width: int, height: int, box, out_w: int, out_h: int) -> int:
    """The DCT scale divisor (1, 2, 4 or 8) for ``box`` of a ``width x height`` JPEG: Pillow's
    ``draft`` rule, the largest that leaves the box at least ``out_w x out_h``. 1 unless the
    box is at least twice the output both ways (at 224 px: a 448 px crop)."""
    bw, bh = box[2] - box[0], box[3] - box[1]
    if bw < 2 * out_w or bh < 2 * out_h:
        return 1
    req_w, req_h = _draft_request(width, height, box, out_w, out_h)
    fits = min(width // req_w, height // req_h)  # what Image.draft computes from the request
    return next(k for k in (8, 4, 2, 1) if fits >= k)


def _draft_request(width: int, height: int, box, out_w: int, out_h: int) -> tuple[int, int]:
    """The whole image's size at which the box would be ``out_w x out_h``."""
    bw, bh = box[2] - box[0], box[3] - box[1]
    return math.ceil(width * out_w / bw), math.ceil(height * out_h / bh)


class PillowImage:
    """Any format Pillow reads; JPEGs drafted to :func:`reduction`'s scale."""

    def __init__(self, data: bytes, path):
        self.img = open_pillow(data, path)
        self.width, self.height = self.img.size

    def decode(self, box, out_w: int, out_h: int) -> tuple[np.ndarray, float]:
        """``(H, W, 3)`` uint8 of the whole image and the scale divisor it was decoded at."""
        img, scale = self.img, 1.0
        if img.format == "JPEG":
            if reduction(self.width, self.height, box, out_w, out_h) > 1 and img.draft(
                    None, _draft_request(self.width, self.height, box, out_w, out_h)):
                scale = self.width / img.size[0]
        with img:
            rgb = img if img.mode == "RGB" else img.convert("RGB")
            return np.array(rgb), scale  # writable: torch.from_numpy warns on read-only


class SimpleJpegImage:
    """A JPEG (not CMYK) decoded by simplejpeg at :func:`reduction`'s scale; strict, so a
    truncated or corrupt file raises ``ValueError`` as Pillow would raise ``OSError``."""

    def __init__(self, data: bytes, height: int, width: int):
        self.data, self.width, self.height = data, width, height

    def decode(self, box, out_w: int, out_h: int) -> tuple[np.ndarray, float]:
        """``(H, W, 3)`` uint8 of the whole image and the scale divisor it was decoded at."""
        k = reduction(self.width, self.height, box, out_w, out_h)
        # the smallest libjpeg-turbo scale (N/8) at least these sizes is exactly 1/k
        arr = simplejpeg.decode_jpeg(self.data, "rgb", min_width=math.ceil(self.width / k),
                                     min_height=math.ceil(self.height / k))
        return arr, self.width / arr.shape[1]


def open_image(path, decoder: str | None = None):
    """The file at ``path`` ready to decode: simplejpeg for a JPEG it can turn into RGB, when
    ``decoder`` (default :func:`default_decoder`) is ``"simplejpeg"``; Pillow otherwise."""
    decoder = default_decoder() if decoder is None else decoder
    if decoder not in DECODERS:
        raise ValueError(f"decoder must be one of {', '.join(DECODERS)}, got {decoder!r}")
    if decoder == "simplejpeg" and simplejpeg is None:
        raise ImportError("decoder='simplejpeg' needs the simplejpeg package")
    data = read_bytes(path)
    if decoder == "simplejpeg" and data.startswith(_JPEG_MAGIC):
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
        if colorspace not in ("CMYK", "YCCK"):  # simplejpeg keeps those as 4 channels
            return SimpleJpegImage(data, height, width)
    return PillowImage(data, path)
