"""Platform layer: where the library's core meets a framework.

The core (:mod:`hyperpar_gdn.ops`, :mod:`hyperpar_gdn.distributed`, :mod:`hyperpar_gdn.inference`)
names no framework: it calls the platform's tensor functions and collectives. Framework code lives
here, one file per framework and concern (``torch_*.py``, ``mindspore_*.py``), each imported only
when its framework is used, and in the per-framework model and training files of
:mod:`hyperpar_gdn.models` (``models/*.py`` torch, ``models/mindspore/``) and
:mod:`hyperpar_gdn.train` (``backends/mindspore_backend.py`` for MindSpore). Under ``HP_PLATFORM=mindspore``
nothing of the core, of this package or of ``models/mindspore`` imports torch.

``get_platform()`` returns the backend chosen by ``HP_PLATFORM`` (``cpu``, ``cuda``, ``npu``,
``mindspore``) or, when unset, the first one available (cuda, then npu if ``torch_npu`` is
installed, then cpu). ``ops_for(tensor)`` returns the tensor functions for a tensor's framework,
so the maths in :mod:`hyperpar_gdn.ops` runs on whichever tensors it is given.

``platform_for_device(device_type)`` serves ``init_device_mesh``: ``HP_PLATFORM`` names the
framework and ``device_type`` the hardware (docs/backends.md):

| HP_PLATFORM | valid device_type | platform |
| --- | --- | --- |
| unset | ``cpu`` / ``cuda`` / ``npu`` | torch with gloo / NCCL / HCCL |
| unset | ``mindspore`` | MindSpore on its current device target |
| ``cpu``, ``cuda``, ``npu`` | the same name | torch on that device |
| ``mindspore`` | ``cpu`` / ``npu`` / ``mindspore`` | MindSpore on CPU (MCCL) / Ascend (HCCL) / its current target |
"""

from __future__ import annotations

import importlib.util
import os
import sys
from functools import cache

from hyperpar_gdn.platform.base import (
    AttentionKernel,
    CollectiveError,
    Collectives,
    Group,
    Platform,
    PlatformUnavailableError,
    Tensor,
    TensorOps,
)
from hyperpar_gdn.platform.device_trace import traced, traced_instance

PLATFORMS = ("cpu", "cuda", "npu", "mindspore")

__all__ = [
    "PLATFORMS",
    "AttentionKernel",
    "CollectiveError",
    "Collectives",
    "Group",
    "Platform",
    "PlatformUnavailableError",
    "Tensor",
    "TensorOps",
    "get_platform",
    "ops_for",
    "platform_for_device",
    "platform_name",
    "resolve_device_type",
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
    if importlib.util.find_spec("torch") is None:
        raise ModuleNotFoundError(
            "HP_PLATFORM is unset and torch is not installed, so no platform can be detected: set "
            "HP_PLATFORM=mindspore for MindSpore, or install torch (the 'torch' extra: "
            "pip install 'hyperpar-gdn[torch]') for HP_PLATFORM cpu, cuda or npu"
        )
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if importlib.util.find_spec("torch_npu") is not None:
        return "npu"
    return "cpu"


# One platform instance per name (a process joins one MindSpore world, on one device target).
_INSTANCES: dict[str, Platform] = {}
_MINDSPORE_TARGETS = {"cpu": "CPU", "npu": "Ascend"}


def _make_platform(name: str, device_target: str | None = None) -> Platform:
    if traced(name):  # a trace without the device (device_trace.py): its own instance
        from hyperpar_gdn.platform.torch_platform import TorchPlatform

        return traced_instance(name, lambda: TorchPlatform(name))
    platform = _INSTANCES.get(name)
    if platform is None:
        if name == "mindspore":
            from hyperpar_gdn.platform.mindspore_platform import MindSporePlatform

            platform = MindSporePlatform(device_target)
        else:
            from hyperpar_gdn.platform.torch_platform import TorchPlatform

            platform = TorchPlatform(name)
        _INSTANCES[name] = platform
    return platform


def get_platform(name: str | None = None) -> Platform:
    """The platform ``name`` (default: :func:`platform_name`); one instance per name."""
    if name is not None and name not in PLATFORMS:
        raise ValueError(f"platform {name!r} is unknown; valid values are {', '.join(PLATFORMS)}")
    return _make_platform(name or platform_name())


def resolve_device_type(device_type: str) -> tuple[str, str | None]:
    """``(platform name, MindSpore device target or None)`` for a mesh of ``device_type`` under
    ``HP_PLATFORM`` (see the module docstring's table). Reads only the environment.

    Raises ``ValueError`` naming ``device_type``, ``HP_PLATFORM`` and the valid device types when
    the framework that ``HP_PLATFORM`` chooses cannot serve ``device_type``."""
    if device_type not in PLATFORMS:
        raise ValueError(f"device_type={device_type!r} is unknown; valid values are {', '.join(PLATFORMS)}")
    chosen = os.environ.get("HP_PLATFORM", "").strip().lower()
    if chosen:
        chosen = platform_name()  # validates the value
    if chosen == "mindspore":
        if device_type == "mindspore":
            return "mindspore", None
        if device_type in _MINDSPORE_TARGETS:
            return "mindspore", _MINDSPORE_TARGETS[device_type]
        raise ValueError(
            f"device_type={device_type!r} cannot be served under HP_PLATFORM='mindspore': MindSpore runs "
            "on device_type 'cpu' (MCCL), 'npu' (Ascend, HCCL) or 'mindspore' (its current device target); "
            f"for torch on {device_type!r} unset HP_PLATFORM or set HP_PLATFORM={device_type}"
        )
    if not chosen or chosen == device_type:
        return device_type, None
    framework = "MindSpore" if device_type == "mindspore" else f"torch on {device_type!r}"
    raise ValueError(
        f"device_type={device_type!r} does not match HP_PLATFORM={chosen!r} (torch on {chosen!r}): "
        f"under it the valid device_type is {chosen!r}; for {framework} set HP_PLATFORM={device_type} "
        "or unset it"
    )


def platform_for_device(device_type: str) -> Platform:
    """The platform that builds a mesh of ``device_type`` (:func:`resolve_device_type`).

    MindSpore serves one device target per process: asking for another one than the MindSpore
    platform already has is a ``ValueError``."""
    name, target = resolve_device_type(device_type)
    platform = _make_platform(name, target)
    have = getattr(platform, "device_target", None)
    if target is not None and have != target:
        raise ValueError(
            f"device_type={device_type!r} needs MindSpore on {target!r}, but this process's MindSpore "
            f"platform runs on {have!r}; one process serves one MindSpore device target"
        )
    return platform


@cache
def _torch_ops() -> TensorOps:
    from hyperpar_gdn.platform.torch_ops import TorchOps

    return TorchOps()


@cache
def _mindspore_ops() -> TensorOps:
    from hyperpar_gdn.platform.mindspore_ops import MindSporeOps

    return MindSporeOps()


def ops_for(x: Tensor) -> TensorOps:
    """Tensor functions for ``x``'s framework (torch or MindSpore), chosen by its type."""
    module = type(x).__module__.split(".")[0]
    if module == "torch" or ("torch" in sys.modules and _torch_ops().is_tensor(x)):
        return _torch_ops()
    if module == "mindspore" or ("mindspore" in sys.modules and _mindspore_ops().is_tensor(x)):
        return _mindspore_ops()
    raise TypeError(f"expected a torch or MindSpore tensor, got {type(x).__name__}")
