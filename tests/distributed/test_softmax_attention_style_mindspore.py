"""SoftmaxAttentionContextParallel under MindSpore (MCCL on CPU, msrun with 2 and 4 workers): our
CausalSelfAttention with shards of different lengths and packed documents that cross them equals
the torch layer on one process (float64), on the blockwise path and the dense reference: output
shard, input-gradient shard and every parameter gradient summed over the ranks. The section runs
in the msrun job the MindSpore tests share (``msrun_harness.cp_worker_job``)."""

from __future__ import annotations

import pytest

pytest.importorskip("mindspore")

from msrun_harness import cp_worker_job, section_data  # noqa: E402

TOL = 1e-10  # float64; RoPE angles are fp32 numpy constants on both sides
KEYS = {
    "output",
    "grad_input",
    *(f"grad_{p}_proj.weight" for p in "qkvo"),
    "grad_q_norm.weight",
    "grad_k_norm.weight",
}


@pytest.mark.parametrize("world", [2, 4], ids=lambda w: f"cp{w}")
def test_attention_cp_uneven_packed_matches_torch(world: int) -> None:
    per_rank = section_data(cp_worker_job(world), "attention")
    assert len(per_rank) == world
    lengths = per_rank[0]["lengths"]
    assert len(set(lengths)) > 1 and len(lengths) == world  # the shards really differ
    for rank, results in enumerate(per_rank):
        for path in ("blockwise", "reference"):
            errors = results[path]
            assert set(errors) == KEYS, sorted(errors)
            bad = {k: v for k, v in errors.items() if not v <= TOL}
            assert not bad, f"rank {rank} {path}: {bad}"
