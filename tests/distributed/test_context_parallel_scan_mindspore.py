"""``mode="scan"`` under MindSpore (MCCL on CPU, msrun with 4 workers, float64) equals the torch
layer run on each document alone, with uneven contiguous shards and in the head_tail layout
(packed documents crossing shards and pieces); the first fragment's owner sends once in each of
the ceil(log2 n) rounds, the state only (K x V per head, no K x K map). The job is the shared
one of the MindSpore tests (``msrun_harness.cp_worker_job``)."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("mindspore")

import msrun_cp_worker as worker  # noqa: E402  (tests/distributed is on sys.path under pytest)
from msrun_harness import cp_worker_job, section_data  # noqa: E402

WORLD = 4
TOL = 1e-10  # float64: rounding only
V = 8  # the torch layer's value head dim (worker.torch_layer)


@pytest.mark.timeout(600)
def test_scan_matches_torch_per_document_in_log_rounds() -> None:
    per_rank = section_data(cp_worker_job(WORLD), "scan")
    assert len(per_rank) == WORLD
    for rank, results in enumerate(per_rank):
        assert sorted(results) == ["head_tail", "uneven"]
        for name, result in results.items():
            errors = result["errors"]
            assert len(errors) == 2 + len(worker.PARAMS), sorted(errors)
            bad = {k: v for k, v in errors.items() if not v <= TOL}
            assert not bad, f"rank {rank} {name}: {bad}"
            if rank == 0:
                fragments = WORLD if name == "uneven" else 2 * WORLD
                sends = result["sends"][: math.ceil(math.log2(fragments))]
                assert all(shape[-1] == V for shape in sends), result["sends"]
        assert len(results["uneven"]["sends"]) == (
            math.ceil(math.log2(WORLD - rank)) + math.ceil(math.log2(rank + 1))
        ), (rank, results["uneven"]["sends"])
