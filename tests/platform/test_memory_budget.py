"""The memory budget of a rank on the CPU: the host's MemAvailable over the local ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from hyperpar_gdn.platform.memory_budget import host_available_bytes, local_ranks, rank_budget


def test_mem_available_is_read_in_bytes(tmp_path: Path) -> None:
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       1000 kB\nMemFree:  10 kB\nMemAvailable:    2048 kB\n")
    assert host_available_bytes(info) == 2048 * 1024
    info.write_text("MemTotal:       1000 kB\n")
    with pytest.raises(ValueError, match="no MemAvailable line"):
        host_available_bytes(info)


def test_cpu_budget_is_shared_by_the_local_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert local_ranks(1) == 4
    budget, source = rank_budget("cpu", ranks_here=4)
    assert 0 < budget <= host_available_bytes() // 4 + 2**20 and "/ 4 local ranks" in source
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert local_ranks(3) == 3
    with pytest.raises(NotImplementedError, match="no memory budget for platform 'mindspore'"):
        rank_budget("mindspore", ranks_here=1)
