"""Two-level CP in the head_tail layout under MindSpore (MCCL on CPU, msrun with 8 workers): the
MindSpore GDN layer under ``ulysses+p2p`` (2 nodes of 4) and ``ulysses+scan`` /
``ulysses+all_gather`` (4 nodes of 2), rank r holding pieces r and 15-r of 16, packed documents
crossing pieces, ranks and nodes, float32: output shard, input-gradient shard and every parameter
gradient summed over the ranks equal the MindSpore layer on one device and the float64 torch layer
run on each document alone. The section runs in the 8-worker msrun job
(``msrun_harness.cp_worker_job(8)``, ``tests/distributed/msrun_two_level_sections.py``)."""

from __future__ import annotations

import pytest

pytest.importorskip("mindspore")

import msrun_two_level_sections as sections  # noqa: E402
from msrun_harness import GDN_PARAMS, cp_worker_job, section_data  # noqa: E402

# docs/maths.md: fp32 max abs error <= 1e-4 relative to each tensor's scale (measured worst here:
# 2.6e-5 against one device, 1.4e-5 against the float64 truth)
TOL = 1e-4
WORLD = 8
KEYS = {"output", "dx", *GDN_PARAMS}


def test_two_level_head_tail_matches_single_device() -> None:
    per_rank = section_data(cp_worker_job(WORLD), "two_level_head_tail")
    assert len(per_rank) == WORLD
    piece = sections.T // (2 * WORLD)
    for rank, results in enumerate(per_rank):
        tail = 2 * WORLD - 1 - rank
        expected = [*range(rank * piece, (rank + 1) * piece), *range(tail * piece, (tail + 1) * piece)]
        assert results.pop("positions") == expected, f"rank {rank}: not the head_tail pieces"
        assert len(results) == len(sections.CASES), sorted(results)
        for case, errors in results.items():
            for reference in ("vs_single", "vs_truth", "single_vs_truth"):
                assert set(errors[reference]) == KEYS, (case, sorted(errors[reference]))
                bad = {k: v for k, v in errors[reference].items() if not v <= TOL}
                assert not bad, f"rank {rank} {case} {reference}: {bad}"
