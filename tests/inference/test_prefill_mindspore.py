"""Prefill under context parallelism for the MindSpore Qwen3.5 model (dense and MoE, fp32, MCCL
through msrun, 2 and 4 workers, every mode, scan included): the states (conv, recurrent, K/V) and
last-token logits equal the single-device prefill's, and the greedy continuation from them equals
its continuation token for token (at cp 2 every mode for dense and p2p for MoE, at cp 4 p2p for
both; the other cases check states only: MindSpore's decoding steps are slow); the dense model's states in the head_tail layout too. The single-device greedy generation
itself equals transformers' (tests/inference/test_decoding_mindspore.py). The msrun jobs are the
shared ones (``msrun_harness.cp_worker_job(2)`` and ``(4)``, section ``prefill``)."""

from __future__ import annotations

import pytest

pytest.importorskip("mindspore")

import msrun_cp_worker as worker  # noqa: E402
from msrun_harness import cp_worker_job, section_data  # noqa: E402

TOL = 1e-4  # fp32 (docs/maths.md): CP against the single-device prefill


@pytest.mark.parametrize("mode", worker.PREFILL_MODES)
@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("world", [2, 4], ids=["cp2", "cp4"])
def test_prefill_continues_like_one_device(world: int, kind: str, mode: str) -> None:
    per_rank = section_data(cp_worker_job(world), "prefill")
    assert len(per_rank) == world
    for rank, results in enumerate(per_rank):
        entry = results[f"{kind}/{mode}"]
        assert entry["length"] == worker.PREFILL_T
        if worker.continues_after_prefill(world, moe=kind == "moe", mode=mode):
            assert entry["tokens"] == entry["expected"], (
                f"rank {rank}: {entry['tokens']} != {entry['expected']}"
            )
            assert len(entry["tokens"][0]) == worker.PREFILL_NEW_TOKENS
            assert len(set(entry["tokens"][0])) > 1, "a constant continuation would not test the steps"
        else:
            assert entry["tokens"] is None
        too_far = {k: v for k, v in entry["errors"].items() if v > TOL}
        assert not too_far, f"rank {rank}: {too_far}"


@pytest.mark.parametrize("mode", worker.PREFILL_MODES)
@pytest.mark.parametrize("world", [2, 4], ids=["cp2", "cp4"])
def test_head_tail_prefill_states_equal_one_device(world: int, mode: str) -> None:
    """layout="head_tail" (pieces r and 2cp-1-r): the same states and logits as one device."""
    for rank, results in enumerate(section_data(cp_worker_job(world), "prefill")):
        entry = results[f"dense/{mode}/head_tail"]
        assert entry["length"] == worker.PREFILL_HEAD_TAIL_T
        assert len(entry["errors"]) == 1 + 2 * 4, entry["errors"]  # the logits, 2 per layer
        too_far = {k: v for k, v in entry["errors"].items() if v > TOL}
        assert not too_far, f"rank {rank}: {too_far}"
