"""Platform layer: the only package that names a framework.

``get_platform()`` returns the backend chosen by ``HP_PLATFORM`` (``cpu``, ``cuda``, ``npu``,
``mindspore``) or, when unset, the first one available (cuda, then npu if ``torch_npu`` is
installed, then cpu). ``ops_for(tensor)`` returns the tensor functions for a tensor's framework,
so the maths in :mod:`hyperpar_gdn.ops` runs on whichever tensors it is given.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from functools import cache

from .base import CollectiveError, Collectives, Group, Platform, Tensor, TensorOps

PLATFORMS = ("cpu", "cuda", "npu", "mindspore")

__all__ = [
    "PLATFORMS",
    "CollectiveError",
    "Collectives",
    "Group",
    "Platform",
    "Tensor",
    "TensorOps",
    "get_platform",
    "ops_for",
    "platform_name",
]


def platform_name() -> str:
    """The platform named by ``HP_PLATFORM``, or the detected one."""
    name = os.environ.get("HP_PLATFORM", "").strip().lower()
    if name:
        if name not in PLATFORMS:
            raise ValueError(
                f"HP_PLATFORM={os.environ['HP_PLATFORM']!r} is not a platform; "
                f"valid values are {', '.join(PLATFORMS)}"
            )
        return name
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if importlib.util.find_spec("torch_npu") is not None:
        return "npu"
    return "cpu"


@cache
def _make_platform(name: str) -> Platform:
    if name == "mindspore":
        from .mindspore_platform import MindSporePlatform

        return MindSporePlatform()
    from .torch_platform import TorchPlatform

    return TorchPlatform(name)


def get_platform(name: str | None = None) -> Platform:
    """The platform ``name`` (default: :func:`platform_name`); one instance per name."""
    if name is not None and name not in PLATFORMS:
        raise ValueError(f"platform {name!r} is unknown; valid values are {', '.join(PLATFORMS)}")
    return _make_platform(name or platform_name())


@cache
def _torch_ops() -> TensorOps:
    from .torch_ops import TorchOps

    return TorchOps()


@cache
def _mindspore_ops() -> TensorOps:
    from .mindspore_ops import MindSporeOps

    return MindSporeOps()


def ops_for(x: Tensor) -> TensorOps:
    """Tensor functions for ``x``'s framework (torch or MindSpore), chosen by its type."""
    module = type(x).__module__.split(".")[0]
    if module == "torch" or ("torch" in sys.modules and _torch_ops().is_tensor(x)):
        return _torch_ops()
    if module == "mindspore" or ("mindspore" in sys.modules and _mindspore_ops().is_tensor(x)):
        return _mindspore_ops()
    raise TypeError(f"expected a torch or MindSpore tensor, got {type(x).__name__}")
