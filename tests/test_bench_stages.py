"""bench_stages' case: the layer cut into stages computes exactly the layer's output (p2p with
contiguous shards, all_gather with head_tail fragments, two real gloo ranks, one launch), every
stage is timed on every rank (or waits where a rank lacks it), and the inherent FLOPs follow the
hand count."""

from __future__ import annotations

from typing import Any

import pytest

from benchkit.cp_layer import LayerShape
from benchkit.cp_stages import STAGES, measure_stages, summary_flops
from benchkit.ranks import on_ranks

SHAPE = {"hidden": 32, "num_k_heads": 1, "num_v_heads": 2, "head_k_dim": 16, "head_v_dim": 16}
JOBS = [
    {"mode": "p2p", "layout": "contiguous"},
    {"mode": "all_gather", "layout": "head_tail"},
]


def _worker(rank: int, cp: int, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [measure_stages(rank, cp, job) for job in jobs]


@pytest.mark.timeout(240)
def test_stages_equal_the_layer_on_two_ranks() -> None:
    jobs = [{**j, "seq_len": 96, "chunk_size": 16, "shape": SHAPE, "repeats": 2, "warmup": 0} for j in JOBS]
    per_rank = on_ranks(_worker, 2, jobs, timeout_s=200)
    for i, job in enumerate(jobs):
        for rank, results in enumerate(per_rank):
            result = results[i]
            assert result["max_abs_diff"] <= 1e-6, (job["mode"], rank, result["max_abs_diff"])
            stages = {name.split("/")[0] for name in result["times_s"] if name != "layer"}
            want = set(STAGES) - ({"layout_reorder"} if job["layout"] == "contiguous" else set())
            if job["layout"] == "contiguous" and rank == 0:
                want -= {"summary"}  # the first shard runs no widened pass; it waits at the barrier
            assert stages == want, (job["mode"], rank, sorted(stages))
            assert all(len(t) == 2 and min(t) > 0 for t in result["times_s"].values())


def test_summary_flops_hand_count() -> None:
    shape = LayerShape(batch=1, num_v_heads=2, head_k_dim=4, head_v_dim=8)
    flops = summary_flops(shape, local_len=10, chunk_size=2, cp=4, mode="all_gather")
    tokens = 2 * 10  # heads x tokens
    assert flops["summary_forward"] == tokens * (6 * 16 + 2 * 2 * 4)
    assert flops["summary_backward"] == tokens * 2 * 4 * 8
    assert flops["exchange_forward"] == 3 * 2 * (2 * 16 * 8)  # cp - 1 folds of M S_in per head
    scan = summary_flops(shape, local_len=10, chunk_size=2, cp=4, mode="scan")
    assert scan["exchange_forward"] == 2 * 2 * (2 * 16 * 8 + 2 * 64)  # two rounds
