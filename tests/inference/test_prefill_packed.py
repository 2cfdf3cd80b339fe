"""Packed prompts: N prompts of unequal length in one row, read under context parallelism, give
each prompt's last-token logits and a cache of its own, equal to that prompt prefilled alone by
transformers (fp64 states, STATE_TOL as in test_prefill) and continued by transformers'
``generate`` token for token like the prompt's own one-device ``generate`` (fp32). Every mode;
cp 4 (dense) and cp 2 (MoE); prompt bounds inside shards, a 3-token prompt (shorter than the
conv width) spanning two ranks. Real gloo groups.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from distributed_harness import run_ranks
from test_prefill import MODES, NEW_TOKENS, STATE_TOL, VOCAB, cache_states, continue_with_generate
from tiny_models import generation_model

from hyperpar_gdn import (
    apply_context_parallel,
    init_device_mesh,
    prefill_context_parallel,
    undo_context_parallel,
)

transformers = pytest.importorskip("transformers")

PROMPTS = (11, 5, 17, 3, 9)  # T=45; bounds 11, 16, 33, 36; cp 4 shards start at 12, 23, 34; cp 2 at 23


def packed_row() -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """(the row [1, 45], each prompt [1, T_n], cu_seqlens [6])."""
    row = torch.randint(1, VOCAB, (1, sum(PROMPTS)), generator=torch.Generator().manual_seed(3))
    cu = torch.tensor([0, *torch.tensor(PROMPTS).cumsum(0).tolist()])
    return row, [row[:, cu[n] : cu[n + 1]] for n in range(len(PROMPTS))], cu


def references(moe: bool) -> dict[str, Any]:
    """One process: the models and, per prompt alone, transformers' greedy continuation (fp32),
    its prefill's last logits and cache states (fp64)."""
    base32, base64 = (
        generation_model(moe=moe, dtype=torch.float32),
        generation_model(moe=moe, dtype=torch.float64),
    )
    _, prompts, _ = packed_row()
    alone = []
    with torch.no_grad():
        for ids in prompts:
            expected = base32.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)[:, ids.shape[1] :]
            out = base64(input_ids=ids, use_cache=True)
            alone.append((expected, out.logits[0, -1], cache_states(out.cache, base64)))
    return {"base32": base32, "base64": base64, "alone": alone}


def _worker(rank: int, world: int, refs: dict[str, Any]) -> list[str]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    row, prompts, cu = packed_row()
    positions = torch.cat([torch.arange(n) for n in PROMPTS]).reshape(1, -1)
    failures = []
    for mode in MODES:
        packing = {"position_ids": positions} if mode == "p2p" else {"cu_seqlens": cu}
        model = apply_context_parallel(copy.deepcopy(refs["base32"]), mesh, mode=mode)
        logits, caches = prefill_context_parallel(model, mesh, row, **packing)
        undo_context_parallel(model)
        if tuple(logits.shape) != (len(PROMPTS), VOCAB) or len(caches) != len(PROMPTS):
            failures.append(f"{mode}: logits {tuple(logits.shape)}, {len(caches)} caches")
            continue
        for n, ids in enumerate(prompts):
            if rank != n % world:  # the continuations are spread over the ranks
                continue
            got = continue_with_generate(model, ids, None, logits[n : n + 1], caches[n])
            if not torch.equal(got, refs["alone"][n][0]):
                failures.append(f"{mode} prompt {n}: {got.tolist()} != {refs['alone'][n][0].tolist()}")
        model = apply_context_parallel(copy.deepcopy(refs["base64"]), mesh, mode=mode)
        logits, caches = prefill_context_parallel(model, mesh, row, **packing)
        for n, (_, ref_logits, ref_states) in enumerate(refs["alone"]):
            err = ((logits[n] - ref_logits).abs().max() / ref_logits.abs().max()).item()
            if err > STATE_TOL:
                failures.append(f"{mode} prompt {n}: logits relative error {err:.1e}")
            states = cache_states(caches[n], refs["base64"])
            for key, ref in ref_states.items():
                got_state = states[key].to(ref.dtype)
                if got_state.shape != ref.shape:
                    failures.append(
                        f"{mode} prompt {n} {key}: shape {tuple(got_state.shape)} != {tuple(ref.shape)}"
                    )
                    continue
                err = ((got_state - ref).abs().max() / ref.abs().max()).item()
                if err > STATE_TOL:
                    failures.append(f"{mode} prompt {n} {key}: relative error {err:.1e} > {STATE_TOL:.0e}")
    return failures


@pytest.mark.parametrize(("world", "moe"), [(4, False), (2, True)], ids=["cp4-dense", "cp2-moe"])
def test_packed_prompts_equal_each_prompt_alone(world: int, moe: bool) -> None:
    for failures in run_ranks(_worker, world, references(moe), timeout_s=400):
        assert not failures, "\n".join(failures)
