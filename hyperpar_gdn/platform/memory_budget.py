"""How much memory one rank may use: the device's memory on an accelerator, the host's available
memory shared by the ranks of this host on the CPU. Read without allocating anything (the memory
plan runs before the model is built)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["host_available_bytes", "local_ranks", "rank_budget"]


def host_available_bytes(meminfo: Path = Path("/proc/meminfo")) -> int:
    """The kernel's estimate of memory available to new work (``MemAvailable`` of /proc/meminfo)."""
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024  # kB
    raise ValueError(f"{meminfo} has no MemAvailable line (Linux 3.14 or newer has it)")


def local_ranks(default: int) -> int:
    """Ranks on this host as the launcher set them (torchrun ``LOCAL_WORLD_SIZE``, msrun
    ``MS_LOCAL_WORKER``), else ``default``."""
    value = os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("MS_LOCAL_WORKER", ""))
    return int(value) if value.strip().isdigit() and int(value) > 0 else default


def rank_budget(platform: str, *, ranks_here: int) -> tuple[int, str]:
    """(bytes, where from) that one rank may use on ``platform`` (cpu, cuda, npu): the device's
    total memory (the device of ``LOCAL_RANK``), or on the CPU the host's available memory
    divided by ``ranks_here``."""
    device = int(os.environ.get("LOCAL_RANK", "0") or 0)
    if platform == "cuda":
        import torch

        total = torch.cuda.get_device_properties(device).total_memory
        return int(total), f"cuda:{device} total memory"
    if platform == "npu":
        import torch
        import torch_npu  # noqa: F401 (registers torch.npu)

        total = torch.npu.get_device_properties(device).total_memory  # type: ignore[attr-defined]
        return int(total), f"npu:{device} total memory"
    if platform == "cpu":
        available = host_available_bytes()
        return available // ranks_here, f"host MemAvailable / {ranks_here} local ranks"
    raise NotImplementedError(f"no memory budget for platform {platform!r}; cpu, cuda and npu have one")
