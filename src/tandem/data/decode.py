"""Image files to ``uint8`` RGB arrays for a training crop: simplejpeg for JPEGs, Pillow otherwise.

Both decode at the smallest ``1/2^k`` scale (k <= 3) that leaves the crop box at least the
output's size (libjpeg's DCT scaling, Pillow's ``draft``), by the same rule, so a JPEG gives
about the same pixels whichever decoded it; at scale ``1/k`` pixel ``i`` is the block that
starts at ``k * i``. A file the decoders refuse raises :class:`UnreadableImage`, naming it.
"""

from __future__ import annotations

import contextlib
import io
import math

import numpy as np
from PIL import Image, UnidentifiedImageError

try:  # a dependency, but a plain Pillow install still runs
    import simplejpeg
except ImportError:  # pragma: no cover - exercised where simplejpeg is absent
    simplejpeg = None

from tandem.errors import TandemError

DECODERS = ("simplejpeg", "pillow")
JPEG_START = b"\xff\xd8\xff"  # a JPEG file's first bytes

# what the decoders raise for a file they refuse: Pillow's OSError (unidentified, truncated),
# SyntaxError, EOFError (its parsers) and DecompressionBombError; simplejpeg's ValueError
DECODER_ERRORS = (OSError, SyntaxError, EOFError, ValueError, Image.DecompressionBombError)


class UnreadableImage(TandemError, OSError):
    """A file the decoders refuse; the message names it, the decoder's error is the cause."""


@contextlib.contextmanager
def decoding(path):
    """Around a decoder's own calls (not tandem's: a ValueError of ours would read as a bad
    file): their :data:`DECODER_ERRORS` become :class:`UnreadableImage` naming ``path``."""
    try:
        yield
    except TandemError:
        raise
    except DECODER_ERRORS as exc:
        raise UnreadableImage(f"unreadable image '{path}': {type(exc).__name__}: {exc}") from exc


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
    """Pillow's image of ``data``, decoded in one call (libjpeg gets the whole file, not 64 KB
    blocks, and never suspends mid-scan); not an image: ``UnidentifiedImageError`` naming it."""
    try:
        img = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise UnidentifiedImageError(f"cannot identify image file '{path}'") from None
    img.decodermaxblock = max(len(data), img.decodermaxblock)  # bytes per decoder call
    return img


def reduction(width: int, height: int, box, out_w: int, out_h: int) -> int:
    """The DCT scale divisor (1, 2, 4 or 8) for ``box`` of a ``width x height`` JPEG: Pillow's
    ``draft`` rule, the largest that leaves the box at least ``out_w x out_h``; 1 for an image
    under 8 pixels both ways (where simplejpeg, picking a scale by size, could take another)."""
    bw, bh = box[2] - box[0], box[3] - box[1]
    if bw < 2 * out_w or bh < 2 * out_h or max(width, height) < 8:
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
        self.path = path
        with decoding(path):
            self.img = open_pillow(data, path)
        self.width, self.height = self.img.size

    def decode(self, box, out_w: int, out_h: int) -> tuple[np.ndarray, int]:
        """``(H, W, 3)`` uint8 of the whole image and the scale divisor ``k`` it was decoded
        at (see module doc: not ``width / decoded width``, which ``k`` need not divide)."""
        img, scale = self.img, 1
        request = None
        if img.format == "JPEG" and reduction(self.width, self.height, box, out_w, out_h) > 1:
            request = _draft_request(self.width, self.height, box, out_w, out_h)
        with img, decoding(self.path):
            drafted = request and img.draft(None, request)
            if drafted:  # Pillow's box of the whole image at its scale: (0, 0, W / k, H / k)
                scale = round(self.width / drafted[1][2])
            rgb = img if img.mode == "RGB" else img.convert("RGB")
            return np.array(rgb), scale  # writable: torch.from_numpy warns on read-only


class SimpleJpegImage:
    """A JPEG (not CMYK) decoded by simplejpeg at :func:`reduction`'s scale; strict, so a
    truncated or corrupt file raises as under Pillow (:class:`UnreadableImage`)."""

    def __init__(self, data: bytes, height: int, width: int, path="<bytes>"):
        self.data, self.width, self.height, self.path = data, width, height, path

    def decode(self, box, out_w: int, out_h: int) -> tuple[np.ndarray, int]:
        """``(H, W, 3)`` uint8 of the whole image and the scale divisor ``k`` it was decoded
        at (see :meth:`PillowImage.decode`)."""
        k = reduction(self.width, self.height, box, out_w, out_h)
        # the smallest libjpeg-turbo scale (N/8) at least these sizes is exactly 1/k
        with decoding(self.path):
            arr = simplejpeg.decode_jpeg(self.data, "rgb", min_width=math.ceil(self.width / k),
                                         min_height=math.ceil(self.height / k))
        return arr, k


def open_image(path, decoder: str | None = None):
    """The file at ``path`` ready to decode: simplejpeg for a JPEG it can turn into RGB, when
    ``decoder`` (default :func:`default_decoder`) is ``"simplejpeg"``; Pillow otherwise."""
    decoder = default_decoder() if decoder is None else decoder
    if decoder not in DECODERS:
        raise ValueError(f"decoder must be one of {', '.join(DECODERS)}, got {decoder!r}")
    if decoder == "simplejpeg" and simplejpeg is None:
        raise ImportError("decoder='simplejpeg' needs the simplejpeg package")
    with decoding(path):
        data = read_bytes(path)
        if decoder == "simplejpeg" and data.startswith(JPEG_START):
            height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
            if colorspace not in ("CMYK", "YCCK"):  # simplejpeg keeps those as 4 channels
                return SimpleJpegImage(data, height, width, path)
    return PillowImage(data, path)
