"""Prefill under context parallelism hands transformers' decoding the prompt's state: the greedy
continuation after a CP prefill equals transformers' one-device ``generate`` token for token
(fp32), and the cache's states equal those of transformers' own prefill (fp64), dense and MoE,
every mode, both token layouts (contiguous and head_tail, whose caches equal each other to fp64
rounding), cp 2 and 4, prompts that do not divide evenly, a conv state spanning ranks (and
head_tail pieces) and left-padded batches. Real gloo groups; the oracle is transformers' model code on one process.

transformers computes the gated delta rule in fp32 whatever the model's dtype, so in fp64 every
state after the first GDN layer agrees with its prefill to fp32 rounding (STATE_TOL, relative;
measured 3e-7 to 7e-6); the modes agree with each other to fp64 rounding (MODES_TOL), and the
first layer's conv state, a projection of the embeddings, exactly (EXACT_TOL).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from distributed_harness import run_ranks
from tiny_models import GENERATION_VOCAB, generation_model

from hyperpar_gdn import (
    apply_context_parallel,
    init_device_mesh,
    prefill_context_parallel,
    undo_context_parallel,
)
from hyperpar_gdn.inference.prefill import prompt_lengths
from hyperpar_gdn.planning.plan import HEAD_MODES

transformers = pytest.importorskip("transformers")

MODES = ("ulysses", "ulysses_hidden", "p2p", "all_gather", "scan")
NEW_TOKENS = 16
EXACT_TOL = 1e-12
STATE_TOL = 2e-5
MODES_TOL = 1e-10
VOCAB = GENERATION_VOCAB


def prompt(t: int, *, padded: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    ids = torch.randint(1, VOCAB, (2, t), generator=torch.Generator().manual_seed(t))
    if not padded:
        return ids, None
    mask = torch.ones(2, t, dtype=torch.int64)
    mask[1, :7] = 0  # left padding of the second row (crosses a shard boundary at cp 4)
    ids[1, :7] = 0
    return ids, mask


def reference_cache(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor | None):
    """transformers' own prefill of the whole prompt (positions as generate gives them)."""
    positions = None
    if mask is not None:
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
    return out.logits[:, -1], out.cache


def continue_with_generate(model, ids, mask, logits, cache) -> torch.Tensor:
    """transformers' generate continuing from the CP prefill: the prompt and the first new token
    in, the cache holding the prompt."""
    first = logits.argmax(-1, keepdim=True)
    extended = torch.cat([ids, first], 1)
    full_mask = None if mask is None else torch.cat([mask, torch.ones_like(first)], 1)
    out = model.generate(
        extended,
        attention_mask=full_mask,
        past_key_values=cache,
        max_new_tokens=NEW_TOKENS - 1,
        do_sample=False,
    )
    return out[:, ids.shape[1] :]


def cache_states(cache, model) -> dict[str, torch.Tensor]:
    states = {}
    for i, layer in enumerate(model.model.layers):
        if getattr(layer, "linear_attn", None) is not None:
            states[f"conv{i}"] = cache.layers[i].conv_states[0]
            states[f"recurrent{i}"] = cache.layers[i].recurrent_states[0]
        else:
            states[f"k{i}"], states[f"v{i}"] = cache.layers[i].keys, cache.layers[i].values
    return states


Case = tuple[int, bool, "list[int] | None", tuple[str, ...]]  # T, padded, lengths, layouts


def references(moe: bool, cases: list[Case]) -> dict[str, Any]:
    """One process, before the ranks fork: the models, transformers' greedy continuation (fp32)
    and its prefill's states and last logits (fp64) per case."""
    base32, base64 = (
        generation_model(moe=moe, dtype=torch.float32),
        generation_model(moe=moe, dtype=torch.float64),
    )
    refs = {"base32": base32, "base64": base64, "cases": []}
    for t, padded, _, _ in cases:
        ids, mask = prompt(t, padded=padded)
        with torch.no_grad():
            expected = base32.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
        logits, cache = reference_cache(base64, ids, mask)
        refs["cases"].append((expected[:, t:], logits, cache_states(cache, base64)))
    return refs


def _worker(rank: int, world: int, refs: dict[str, Any], cases: list[Case]) -> list[str]:
    """Every mode and layout on every case; returns the failures seen by this rank. Rank 0 also
    continues each prefill with transformers' generate (the states are the same on every rank)."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    failures = []
    for (t, padded, lengths, layouts), (expected, ref_logits, ref_states) in zip(
        cases, refs["cases"], strict=True
    ):
        ids, mask = prompt(t, padded=padded)
        first_mode_states = None
        for layout, mode in ((layout, mode) for layout in layouts for mode in MODES):
            cut = lengths or (prompt_lengths(t, world) if layout == "contiguous" else "2cp pieces")
            name = f"T{t}-{'padded' if padded else 'full'}-{layout}-{cut}"
            if mode not in HEAD_MODES and lengths is not None and min(lengths) < 3:
                continue  # p2p and all_gather need W-1 tokens per shard
            # fp32: greedy continuation token for token (the prefill on every rank, generate on rank 0)
            model = apply_context_parallel(copy.deepcopy(refs["base32"]), mesh, mode=mode, layout=layout)
            logits, cache = prefill_context_parallel(model, mesh, ids, attention_mask=mask, lengths=lengths)
            undo_context_parallel(model)
            if rank == 0:
                got = continue_with_generate(model, ids, mask, logits, cache)
                if not torch.equal(got, expected):
                    failures.append(
                        f"{name} {mode}: continuation {got.tolist()} != generate's {expected.tolist()}"
                    )
            # fp64: the cache's states on every rank
            model = apply_context_parallel(copy.deepcopy(refs["base64"]), mesh, mode=mode, layout=layout)
            logits, cache = prefill_context_parallel(model, mesh, ids, attention_mask=mask, lengths=lengths)
            err = ((logits - ref_logits).abs().max() / ref_logits.abs().max()).item()
            if err > STATE_TOL:
                failures.append(f"{name} {mode}: last-token logits relative error {err:.1e}")
            states = cache_states(cache, refs["base64"])
            for key, ref in ref_states.items():
                tol = EXACT_TOL if key == "conv0" else STATE_TOL
                got_state = states[key].to(ref.dtype)
                if got_state.shape != ref.shape:
                    failures.append(
                        f"{name} {mode} {key}: shape {tuple(got_state.shape)} != {tuple(ref.shape)}"
                    )
                    continue
                err = ((got_state - ref).abs().max() / ref.abs().max()).item()
                if err > tol:
                    failures.append(f"{name} {mode} {key}: relative error {err:.1e} > {tol:.0e}")
            if first_mode_states is None:
                first_mode_states = states
            else:
                for key, ref in first_mode_states.items():
                    err = ((states[key] - ref).abs().max() / ref.abs().max()).item()
                    if err > MODES_TOL:
                        failures.append(
                            f"{name} {mode} {key}: differs from {layouts[0]} {MODES[0]} by {err:.1e}"
                        )
    return failures


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_prefill_cp2_continues_like_generate(moe: bool) -> None:
    # 19 + 18 tokens; left padding in both layouts (head_tail: pieces of 8)
    cases = [(37, False, None, ("contiguous",)), (32, True, None, ("contiguous", "head_tail"))]
    for failures in run_ranks(_worker, 2, references(moe, cases), cases, timeout_s=300):
        assert not failures, "\n".join(failures)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_prefill_cp4_continues_like_generate(moe: bool) -> None:
    # 10+9+9+9; the conv state (W=4) spanning the last two ranks (12+12+10+3); a last shard
    # shorter than the conv halo (ulysses: 12+12+11+2) with left padding; head_tail with pieces of
    # 3 (the conv state spans rank 0's and rank 1's tail pieces) and, left-padded, of 4.
    cases = [
        (37, False, None, ("contiguous",)),
        (37, False, [12, 12, 10, 3], ("contiguous",)),
        (37, True, [12, 12, 11, 2], ("contiguous",)),
        (24, False, None, ("contiguous", "head_tail")),
        (32, True, None, ("head_tail",)),
    ]
    for failures in run_ranks(_worker, 4, references(moe, cases), cases, timeout_s=400):
        assert not failures, "\n".join(failures)


def _hybrid_worker(rank: int, world: int, base: torch.nn.Module) -> list[str]:
    """HybridLM: every mode's prefill state, in both layouts, continues greedily like the
    one-device prefill, and the states equal its states (fp64)."""
    from hyperpar_gdn.inference.decoding import greedy_continue, prefill

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    failures = []
    for layout, t in (("contiguous", 29), ("head_tail", 28)):
        ids = torch.randint(0, 61, (2, t), generator=torch.Generator().manual_seed(5))
        ref_logits, ref_state = prefill(base, ids)
        expected = greedy_continue(base, ref_logits, ref_state, max_new_tokens=NEW_TOKENS)
        for mode in MODES:
            model = apply_context_parallel(copy.deepcopy(base), mesh, mode=mode, layout=layout)
            logits, state = prefill_context_parallel(model, mesh, ids)
            undo_context_parallel(model)
            got = greedy_continue(model, logits, state, max_new_tokens=NEW_TOKENS)
            if not torch.equal(got, expected):
                failures.append(f"{layout} {mode}: {got.tolist()} != {expected.tolist()}")
            if state.length != t:
                failures.append(f"{layout} {mode}: state.length={state.length}")
            pairs = [(logits, ref_logits)] + [
                (a, b)
                for pair, ref in zip(state.layers, ref_state.layers, strict=True)
                for a, b in zip(pair, ref, strict=True)
            ]
            for i, (a, b) in enumerate(pairs):
                err = ((a - b).abs().max() / b.abs().max()).item()
                if err > MODES_TOL:
                    failures.append(f"{layout} {mode}: tensor {i} relative error {err:.1e}")
    return failures


def test_hybrid_lm_prefill_continues_like_one_device() -> None:
    from hyperpar_gdn.models import HybridLM, HybridLMConfig

    torch.manual_seed(0)
    base = HybridLM(HybridLMConfig(num_layers=4, vocab_size=61, initializer_range=0.3)).double().eval()
    for failures in run_ranks(_hybrid_worker, 2, base, timeout_s=120):
        assert not failures, "\n".join(failures)


def _refusals_worker(rank: int, world: int, base: torch.nn.Module) -> list[str]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    ids = torch.randint(1, VOCAB, (2, 12))
    right_padded = torch.ones(2, 12, dtype=torch.int64)
    right_padded[1, -2:] = 0
    model = copy.deepcopy(base)
    short_range = copy.deepcopy(base)
    short_range.config.max_position_embeddings = 8
    messages = []
    calls = [
        lambda: prefill_context_parallel(model, mesh, ids),  # not under CP yet
        lambda: prefill_context_parallel(
            apply_context_parallel(model, mesh, mode="p2p"), mesh, ids, lengths=[5, 5]
        ),
        lambda: prefill_context_parallel(model, mesh, ids, attention_mask=right_padded),
        lambda: prefill_context_parallel(model, mesh, ids[0]),
        lambda: prefill_context_parallel(
            apply_context_parallel(short_range, mesh, mode="p2p"), mesh, ids
        ),  # 12 tokens, positions up to 8
        lambda: prefill_context_parallel(
            apply_context_parallel(undo_context_parallel(model), mesh, mode="p2p", layout="head_tail"),
            mesh,
            ids[:, :10],
        ),
        lambda: prefill_context_parallel(model, mesh, ids, lengths=[6, 6]),
        # on rank 0 alone: a refusal after any collective would hang here instead
        lambda: prefill_context_parallel(model, mesh, ids[:, :10]) if rank == 0 else "not called",
        lambda: prefill_context_parallel(model, mesh, ids[:1], cu_seqlens=[0, 5, 12]),  # head_tail
        lambda: prefill_context_parallel(short_range, mesh, ids[:1], cu_seqlens=torch.tensor([0, 5, 5, 12])),
        lambda: prefill_context_parallel(short_range, mesh, ids, cu_seqlens=[0, 5, 12]),
        lambda: prefill_context_parallel(
            short_range, mesh, ids[:1], position_ids=torch.arange(12).reshape(1, 12) % 7
        ),
    ]
    for call in calls:
        try:
            result = call()
            messages.append(result if isinstance(result, str) else "no error")
        except (ValueError, NotImplementedError) as err:
            messages.append(str(err))
    return messages


def test_refuses_bad_input() -> None:
    base = generation_model(moe=False, dtype=torch.float32)
    for rank, messages in enumerate(run_ranks(_refusals_worker, 2, base, timeout_s=120)):
        assert "is not under context parallelism: call apply_context_parallel" in messages[0]
        assert "lengths=[5, 5] must give each of cp=2 ranks at least one token and sum to T=12" in messages[1]
        assert "rows [1] end in padding" in messages[2]
        assert "the prompt must be input_ids [B, T] with T >= 1; got shape (12,)" in messages[3]
        assert messages[4] == (
            "the prompt has T=12 tokens, more than the model's position range max_position_embeddings=8"
        )
        assert messages[5].startswith(
            "layout='head_tail' cuts the sequence into 4 equal pieces: T=10 is not divisible by 4 (2*cp, cp=2)"
        )
        assert (
            "lengths=[6, 6] chooses contiguous pieces; a model parallelized with layout='head_tail'"
            in messages[6]
        )
        # rank 0 alone refused without waiting for rank 1
        assert messages[7] == (messages[5] if rank == 0 else "not called")
        assert messages[8] == (
            "packed prompts need a model parallelized with layout='contiguous'; got layout='head_tail'"
        )
        assert messages[9] == (
            "the packed row holds an empty prompt: prompts [1] of cu_seqlens=[0, 5, 5, 12] have no tokens"
        )
        assert messages[10] == "packed prompts are one row: input_ids must be [1, T]; got B=2"
        # packed prompts of 7 and 5 tokens: within the position range of 8
        assert messages[11] == "no error"
