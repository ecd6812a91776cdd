"""A CUDA stream of its own for ``--decode gpu``, so the decoder never writes into memory that
the train step has queued work on.

``torchvision.io.decode_jpeg(..., device="cuda")`` takes its output from the caching
allocator on the current stream, then lets nvJPEG write into it out of that stream's order
(on a private stream, and on recent GPUs through the hardware decoder). The allocator hands a
block back the moment it is freed on its stream, so when the decode runs on the train step's
stream it can be given memory which the step's backward or optimizer kernels, already queued,
still read: they then see the decoded pixels instead (torchvision PR 9606 and TorchCodec PR
1634 measured it on an H100). Here the decode and the crops run on a side stream that has no
work queued when the decode starts (the host waits for it: only the last batch's crops), so the
decoder is only handed blocks that nothing reads. The batch is then handed to the step's
stream: that stream waits for the side stream, and the block is not reused until the step's
kernels are done with it. The train step keeps running while the next batch decodes.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["DecodeStream"]


class DecodeStream:
    """Where the device half of a GPU decode runs: a side stream on CUDA, inline elsewhere
    (the CPU device, in the tests, where nothing is queued)."""

    def __init__(self, device: torch.device):
        device = torch.device(device)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def decoding(self):
        """Run the block's decode and crops on the side stream, once its earlier work is done
        (a host wait on the side stream alone: the train step's stream runs on)."""
        if self.stream is None:
            yield
            return
        self.stream.synchronize()
        with torch.cuda.stream(self.stream):
            yield

    def hand_over(self, images: torch.Tensor) -> torch.Tensor:
        """``images``, made on the side stream, ready for the current stream: it waits for
        them, and their memory is not reused until its own queued work is done."""
        if self.stream is None:
            return images
        current = torch.cuda.current_stream(self.stream.device)
        current.wait_stream(self.stream)
        images.record_stream(current)
        return images
