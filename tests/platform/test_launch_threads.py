"""hyperpar_gdn.platform.launch's ``threads`` option (what the benchmarks' ranks run with), and
its refusal of a bad value before any process starts."""

from __future__ import annotations

import os

import pytest
import torch

from hyperpar_gdn.platform.launch import launch_ranks, run_ranks


def _threads(rank: int, world_size: int) -> tuple[int, str, int]:
    from hyperpar_gdn.platform import get_platform

    x = torch.ones(1)
    get_platform().collectives.all_reduce_sum(x, None)  # the group is real
    return torch.get_num_threads(), os.environ["OMP_NUM_THREADS"], int(x.item())


def test_ranks_run_with_the_threads_asked_for() -> None:
    assert run_ranks(_threads, 2, threads=2, timeout_s=60) == [(2, "2", 2)] * 2


def test_bad_threads_is_refused_before_any_rank_starts() -> None:
    with pytest.raises(ValueError, match="threads=0 must be >= 1"):
        launch_ranks(_threads, 2, threads=0, timeout_s=60)
