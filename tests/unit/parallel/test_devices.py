import pytest
import torch

from tandem.cli.common import error_line
from tandem.parallel.devices import parse_device_spec, resolve_devices, as_device


def test_repeated_cpu_kept():
    assert resolve_devices(["cpu", "cpu", torch.device("cpu")]) == [torch.device("cpu")] * 3


def test_none_without_cuda_is_one_cpu():
    if torch.cuda.is_available():
        pytest.skip("machine has CUDA")
    assert resolve_devices(None) == [torch.device("cpu")]


@pytest.mark.parametrize("bad", ["gpu", "nonsense:3", 3.5, -1, True, []])
def test_bad_entry_is_value_error_naming_it(bad):
    with pytest.raises(ValueError) as info:
        resolve_devices(bad if isinstance(bad, list) else [bad])
    if not isinstance(bad, list):
        assert repr(bad) in str(info.value)


def test_cuda_ordinal_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("machine has CUDA")
    with pytest.raises(ValueError, match="CUDA is not available"):
        as_device(0)


@pytest.mark.parametrize("flag,n", [("cpu", 1), ("cpu:3", 3), ("CPU:2", 2)])
def test_flag(flag, n):
    assert parse_device_spec(flag, "devices") == [torch.device("cpu")] * n


@pytest.mark.parametrize("flag", ["cpu:0", "cpu:x", "tpu", "cuda:a"])
def test_bad_flag(flag):
    with pytest.raises(ValueError, match="^bad devices ") as caught:
        parse_device_spec(flag, "devices")
    assert error_line(caught.value).startswith("bad --devices ")  # the CLI's words
