"""Decoding on the CP group with the attention K/V cache kept sharded: after a CP prefill, greedy
decoding of 33 tokens (32 steps, each merging the ranks' partial attention by log-sum-exp) equals
transformers' one-device ``generate`` token for token (fp32), dense and MoE, cp 2 and 4; every
rank keeps within one token of (T + steps) / cp of K/V. The same for this package's torch
``HybridLM`` against its one-device greedy continuation (cp 2; the MindSpore model is
tests/inference/test_decoding_cp_mindspore.py). The merge of partials equals attention
over the concatenated keys (fp64, MERGE_TOL). Real gloo groups.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from distributed_harness import run_ranks
from test_prefill import VOCAB
from tiny_models import generation_model

from hyperpar_gdn import (
    apply_context_parallel,
    init_device_mesh,
    prefill_context_parallel,
    undo_context_parallel,
)
from hyperpar_gdn.inference.cp_decoding import (
    greedy_continue_context_parallel,
    kv_tokens_per_rank,
    shard_cache,
)
from hyperpar_gdn.ops.attention.partials import merge_partials, merged_reference, partial_attention
from hyperpar_gdn.platform import ops_for

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 33
MERGE_TOL = 1e-12


@pytest.mark.parametrize("sizes", [(5, 0, 9), (1, 7, 3, 12)], ids=["with-empty-part", "four-parts"])
def test_merge_partials_equals_attention_over_all_keys(sizes: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 1, 16, generator=g, dtype=torch.float64)
    ks = [torch.randn(2, 2, n, 16, generator=g, dtype=torch.float64) * 3 for n in sizes]
    vs = [torch.randn(2, 2, n, 16, generator=g, dtype=torch.float64) for n in sizes]
    xp = ops_for(q)
    parts = [partial_attention(xp, q, k, v, scale=0.25) for k, v in zip(ks, vs, strict=True)]
    merged = merge_partials(xp, torch.stack([o for o, _ in parts]), torch.stack([lse for _, lse in parts]))
    expected = merged_reference(xp, q, ks, vs, scale=0.25)
    assert (merged - expected).abs().max().item() <= MERGE_TOL
    # and the reference is transformers-free softmax attention with repeated kv heads
    k_all, v_all = (torch.cat(x, 2).repeat_interleave(3, 1) for x in (ks, vs))
    direct = torch.softmax(q @ k_all.transpose(2, 3) * 0.25, -1) @ v_all
    assert (expected - direct).abs().max().item() <= MERGE_TOL


def references(moe: bool) -> dict[str, Any]:
    base = generation_model(moe=moe, dtype=torch.float32)
    ids = torch.randint(1, VOCAB, (2, 29), generator=torch.Generator().manual_seed(11))
    expected = {}
    with torch.no_grad():  # head_tail reads 24 tokens (divisible by 2cp = 4 and 8), contiguous 29
        for layout, prompt in (("contiguous", ids), ("head_tail", ids[:, 5:])):
            out = base.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
            expected[layout] = (prompt, out[:, prompt.shape[1] :])
    return {"base": base, "expected": expected}


def _worker(rank: int, world: int, refs: dict[str, Any], layout: str) -> list[str]:

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    ids, expected = refs["expected"][layout]
    failures = []
    model = apply_context_parallel(copy.deepcopy(refs["base"]), mesh, mode="p2p", layout=layout)
    logits, cache = prefill_context_parallel(model, mesh, ids)
    try:
        shard_cache(model, mesh, cache, length=ids.shape[1])
        failures.append("a model still under CP was not refused")
    except ValueError as err:
        if "still under context parallelism: call undo_context_parallel(model)" not in str(err):
            failures.append(f"unexpected refusal: {err}")
    undo_context_parallel(model)
    state = shard_cache(model, mesh, cache, length=ids.shape[1])
    del cache
    got = greedy_continue_context_parallel(model, mesh, logits, state, max_new_tokens=NEW_TOKENS)
    if not torch.equal(got, expected):
        failures.append(f"{layout}: {got.tolist()} != generate's {expected.tolist()}")
    kept = {k.shape[2] for k in state.keys.values()}
    want = int(kv_tokens_per_rank(ids.shape[1] + NEW_TOKENS - 1, world)[rank])
    if kept != {want}:
        failures.append(f"{layout}: rank {rank} keeps {kept} tokens of K/V, expected {want}")
    try:  # a model without a sharded cache (transformers' text model has no LM head): refused
        shard_cache(refs["base"].model, mesh, None, length=4)
        failures.append("a transformers text model was not refused")
    except NotImplementedError as err:
        text_model = type(refs["base"].model).__name__  # Qwen3_5TextModel or Qwen3_5MoeTextModel
        if f"; {text_model} has no sharded cache: decode on one device" not in str(err):
            failures.append(f"unexpected refusal: {err}")
    if world == 2 and layout == "contiguous":
        failures += _hybrid_lm_case(mesh, rank, world)
    return failures


def _hybrid_lm_case(mesh: Any, rank: int, world: int) -> list[str]:
    """This package's torch HybridLM on the same group: sharded greedy decoding equals its
    one-device greedy continuation."""
    from hyperpar_gdn.inference.decoding import greedy_continue, prefill
    from hyperpar_gdn.models import HybridLM, HybridLMConfig

    torch.manual_seed(0)
    model = HybridLM(HybridLMConfig(num_layers=4, vocab_size=61, initializer_range=0.3))
    ids = torch.randint(0, 61, (2, 13), generator=torch.Generator().manual_seed(1))
    logits, state = prefill(model, ids)
    expected = greedy_continue(model, logits, state, max_new_tokens=NEW_TOKENS)
    apply_context_parallel(model, mesh, mode="p2p")
    cp_logits, cp_state = prefill_context_parallel(model, mesh, ids)
    undo_context_parallel(model)
    sharded = shard_cache(model, mesh, cp_state, length=13)
    got = greedy_continue_context_parallel(model, mesh, cp_logits, sharded, max_new_tokens=NEW_TOKENS)
    failures = [] if torch.equal(got, expected) else [f"HybridLM: {got.tolist()} != {expected.tolist()}"]
    kept = {k.shape[2] for k in sharded.keys.values()}
    if kept != {int(kv_tokens_per_rank(13 + NEW_TOKENS - 1, world)[rank])}:
        failures.append(f"HybridLM: rank {rank} keeps {kept} tokens of K/V")
    if len(set(expected[0].tolist())) < 2:
        failures.append("HybridLM: a constant continuation would not test the steps")
    return failures


@pytest.mark.parametrize(
    ("world", "moe", "layout"),
    [(2, False, "contiguous"), (4, True, "contiguous"), (2, True, "head_tail"), (4, False, "head_tail")],
    ids=["cp2-dense", "cp4-moe", "cp2-moe-head_tail", "cp4-dense-head_tail"],
)
def test_decoding_on_cp_group_equals_generate(world: int, moe: bool, layout: str) -> None:
    for failures in run_ranks(_worker, world, references(moe), layout, timeout_s=400):
        assert not failures, "\n".join(failures)
