"""trace_without_device: the cuda platform is built inside it on a machine without CUDA, refused
outside it, and nothing of it stays after (the platform instance made inside is dropped)."""

from __future__ import annotations

import pytest
import torch

from hyperpar_gdn.platform import PlatformUnavailableError, get_platform
from hyperpar_gdn.platform.device_trace import trace_without_device, traced
from hyperpar_gdn.platform.torch_platform import TorchPlatform

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")


def test_cuda_platform_only_inside_the_trace() -> None:
    with pytest.raises(PlatformUnavailableError, match="torch.cuda.is_available"):
        TorchPlatform("cuda")
    with trace_without_device("cuda"):
        assert traced("cuda") and not traced("cpu")
        platform = get_platform("cuda")
        assert platform.device == torch.device("cuda", 0)
        assert platform.collectives.device == torch.device("cuda", 0)  # where all_gather_int's tensors go
        assert get_platform("cuda") is platform
    assert not traced("cuda")
    with pytest.raises(PlatformUnavailableError):
        get_platform("cuda")  # the instance made inside was dropped


def test_only_cuda_can_be_traced() -> None:
    with pytest.raises(ValueError, match="name='npu'.*cuda"), trace_without_device("npu"):
        pass


def test_device_index_from_the_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    """LOCAL_RANK picks among several visible devices; with one visible device (a launcher that
    gives each process its own) it is index 0; more processes than devices is an error."""
    with trace_without_device("cuda"):
        platform = TorchPlatform("cuda")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert platform.device == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert platform.device == torch.device("cuda", 3)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match="LOCAL_RANK=3 but this process sees 2 cuda devices"):
        _ = platform.device
