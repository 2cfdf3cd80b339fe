"""Prefill under context parallelism for the MindSpore Qwen3.5 model (dense and MoE, fp32, MCCL
through msrun, 2 workers, every mode): the states (conv, recurrent, K/V) and last-token logits
equal the single-device prefill's, and the greedy continuation from them equals its continuation
token for token (every mode for dense; p2p for MoE, whose other modes only check states). The single-device greedy generation itself equals transformers'
(tests/inference/test_decoding_mindspore.py). The msrun job is the shared one
(``msrun_harness.cp_worker_job``, section ``prefill``)."""

from __future__ import annotations

import pytest

pytest.importorskip("mindspore")

import msrun_cp_worker as worker  # noqa: E402
from msrun_harness import cp_worker_job, section_data  # noqa: E402

TOL = 1e-4  # fp32 (docs/maths.md): CP against the single-device prefill


@pytest.mark.parametrize("mode", worker.MODES)
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_prefill_continues_like_one_device(kind: str, mode: str) -> None:
    per_rank = section_data(cp_worker_job(2), "prefill")
    for rank, results in enumerate(per_rank):
        entry = results[f"{kind}/{mode}"]
        assert entry["length"] == worker.PREFILL_T
        if kind == "dense" or mode == "p2p":
            assert entry["tokens"] == entry["expected"], (
                f"rank {rank}: {entry['tokens']} != {entry['expected']}"
            )
            assert len(entry["tokens"][0]) == worker.PREFILL_NEW_TOKENS
            assert len(set(entry["tokens"][0])) > 1, "a constant continuation would not test the steps"
        else:
            assert entry["tokens"] is None
        too_far = {k: v for k, v in entry["errors"].items() if v > TOL}
        assert not too_far, f"rank {rank}: {too_far}"
