"""A CUDA stream of its own for ``--decode gpu``: nvJPEG writes out of the current stream's
order, so on the step's stream it could be handed a block the step's queued kernels still read
(torchvision PR 9606). A side stream with nothing queued is handed only free blocks; the batch
then passes to the step's stream (``wait_stream``, ``record_stream``).
"""

from __future__ import annotations

import contextlib

import torch


class DecodeStream:
    """Where a GPU decode runs: a side stream on CUDA, inline elsewhere."""

    def __init__(self, device: torch.device):
        device = torch.device(device)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def decoding(self):
        """The block on the side stream, once its earlier work is done (the step runs on)."""
        if self.stream is None:
            yield
            return
        self.stream.synchronize()
        with torch.cuda.stream(self.stream):
            yield

    def hand_over(self, images: torch.Tensor) -> torch.Tensor:
        """``images``, made on the side stream, ready for the current stream."""
        if self.stream is None:
            return images
        current = torch.cuda.current_stream(self.stream.device)
        current.wait_stream(self.stream)
        images.record_stream(current)
        return images
