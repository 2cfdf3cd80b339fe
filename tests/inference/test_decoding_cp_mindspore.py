"""Decoding on the CP group for the MindSpore Qwen3.5 model (fp32, MCCL through msrun, 2 workers):
after a p2p CP prefill, greedy decoding of 33 tokens (32 steps, each merging the ranks' partial
attention by log-sum-exp) with the attention K/V kept sharded equals the single-device MindSpore
greedy continuation token for token (which equals transformers' ``generate``:
tests/inference/test_decoding_mindspore.py); each rank keeps ``kv_tokens_per_rank`` tokens of K/V;
a model still under CP and a cell without a sharded cache are refused on every rank. The msrun
job is the shared one (``msrun_harness.cp_worker_job``, section ``cp_decoding``)."""

from __future__ import annotations

import pytest

pytest.importorskip("mindspore")

import msrun_cp_worker as worker  # noqa: E402
from msrun_harness import cp_worker_job, section_data  # noqa: E402

from hyperpar_gdn.inference.cp_decoding import kv_tokens_per_rank  # noqa: E402

WORLD = 2


@pytest.fixture(scope="module")
def per_rank() -> list[dict]:
    return section_data(cp_worker_job(WORLD), "cp_decoding")


def test_greedy_on_cp_group_equals_one_device(per_rank: list[dict]) -> None:
    for rank, entry in enumerate(per_rank):
        assert entry["tokens"] == entry["expected"], f"rank {rank}: {entry['tokens']} != {entry['expected']}"
        assert len(entry["tokens"][0]) == worker.CP_DECODING_NEW_TOKENS
        assert len(set(entry["tokens"][0])) > 1, "a constant continuation would not test the steps"


def test_each_rank_keeps_its_share_of_kv(per_rank: list[dict]) -> None:
    length = worker.PREFILL_T + worker.CP_DECODING_NEW_TOKENS - 1
    want = kv_tokens_per_rank(length, WORLD)
    for rank, entry in enumerate(per_rank):
        assert entry["length"] == length
        assert entry["kept"] == [int(want[rank])], (
            f"rank {rank}: keeps {entry['kept']}, expected {want[rank]}"
        )
    start = [entry["kv_bytes"][0] for entry in per_rank]
    assert start[0] > start[1] > 0, f"the longer prompt piece first: bytes {start}"


def test_refused_on_every_rank(per_rank: list[dict]) -> None:
    for rank, entry in enumerate(per_rank):
        under_cp, no_cache = entry["refused"]["under_cp"], entry["refused"]["no_cache"]
        assert under_cp is not None and under_cp.startswith("ValueError: layer 0 is still under context"), (
            f"rank {rank}: {under_cp}"
        )
        assert no_cache == (
            "NotImplementedError: decoding on the CP group keeps the caches of transformers' Qwen3.5 "
            "causal LMs and of this package's LMs sharded; GatedDeltaNet has no sharded cache: decode "
            "on one device"
        ), f"rank {rank}: {no_cache}"
