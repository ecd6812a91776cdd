"""Data and a model that cost time on a virtual clock, for tests/unit/train/test_data_wait.py:
loading a sample or running a forward moves :func:`clock` on by a fixed amount, and nothing else
does, so the data wait's share is known without timing anything (``--data slow_parts:slow_data``, ``-a
slow_parts:slow_net``)."""

from own_model import Net, Pairs

SAMPLE_SECONDS = 1.0  # a loaded sample, on the virtual clock
FORWARD_SECONDS = 10.0  # a forward pass, on the virtual clock
_offset = [0.0]


def clock() -> float:
    """The virtual time spent so far: the real clock is left out, since a busy machine's slow
    step took the slow data's share under its 90% (a test that timed the machine)."""
    return _offset[0]


class SlowPairs(Pairs):
    def __getitem__(self, i):
        _offset[0] += SAMPLE_SECONDS
        return super().__getitem__(i)


class SlowNet(Net):
    def forward(self, x):
        _offset[0] += FORWARD_SECONDS
        return super().forward(x)


def slow_data():
    return SlowPairs(24, seed=0), Pairs(8, seed=1), ("a", "b", "c")


def fast_data():
    return Pairs(24, seed=0), Pairs(8, seed=1), ("a", "b", "c")


def slow_net(num_classes, in_channels):
    return SlowNet(num_classes, in_channels)


def fast_net(num_classes, in_channels):
    return Net(num_classes, in_channels)
