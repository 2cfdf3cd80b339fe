"""Prefill and decoding on a (cp, tp) group: a model split by ``apply_tensor_parallel`` before
``apply_context_parallel``, 4 gloo ranks (cp 2 x tp 2), fp64.

- transformers' dense Qwen3.5: after the TP x CP prefill every rank's cache holds its TP rank's
  heads, each state equal to those heads' slice of transformers' own one-device prefill (conv
  channels, recurrent states, attention K/V; STATE_TOL as in test_prefill), the last logits too;
  the greedy continuation on the (cp, tp) group (K/V sharded over cp, heads over tp) and
  transformers' ``generate`` on each TP group from the TP cache equal ``generate`` on one device,
  and so does ``generate`` of the TP model from the bare prompt; three prompts packed in one row
  leave each its own cache, equal to its heads' slice of transformers' prefill of that prompt alone;
- transformers' MoE model (scan, head_tail) and our ``HybridLM`` (ulysses, contiguous: value
  heads split over tp x cp): the continuation on the group equals the one-device one.
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
    apply_tensor_parallel,
    init_device_mesh,
    prefill_context_parallel,
    undo_context_parallel,
)
from hyperpar_gdn.inference.cp_decoding import greedy_continue_context_parallel, shard_cache

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 10
CU = (0, 7, 16, 24)  # three packed prompts in a row of T tokens; the second spans both CP ranks
STATE_TOL = 2e-5  # transformers' GDN rule runs in fp32 in an fp64 model (test_prefill)
T = 24  # divisible by 2cp = 4: both layouts


def _prompt() -> torch.Tensor:
    return torch.randint(1, GENERATION_VOCAB, (2, T), generator=torch.Generator().manual_seed(5))


def references() -> dict[str, Any]:
    """One process: the models, transformers' prefill states and last logits and its greedy
    continuation (dense, MoE), our HybridLM's one-device continuation."""
    from hyperpar_gdn.inference.decoding import greedy_continue, prefill
    from hyperpar_gdn.models import HybridLM, HybridLMConfig

    ids, refs = _prompt(), {}
    for kind in ("dense", "moe"):
        base = generation_model(moe=kind == "moe", dtype=torch.float64)
        with torch.no_grad():
            out = base(input_ids=ids, use_cache=True)
            expected = base.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)[:, T:]
        refs[kind] = {"base": base, "logits": out.logits[:, -1], "cache": out.cache, "expected": expected}
    with torch.no_grad():  # each packed prompt alone (the first row's tokens)
        alone = [
            refs["dense"]["base"](input_ids=ids[:1, a:b], use_cache=True)
            for a, b in zip(CU[:-1], CU[1:], strict=True)
        ]
    refs["dense"]["packed"] = [(out.logits[0, -1], out.cache) for out in alone]
    torch.manual_seed(0)
    hybrid = HybridLM(HybridLMConfig(num_layers=4, vocab_size=61, initializer_range=0.3)).double()
    hybrid_ids = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(1))
    logits, state = prefill(hybrid, hybrid_ids)
    expected = greedy_continue(hybrid, logits, state, max_new_tokens=NEW_TOKENS)
    refs["hybrid"] = {"base": hybrid, "ids": hybrid_ids, "expected": expected}
    return refs


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def _local_rows(model: Any, layer: int, tp: int, r: int) -> dict[str, torch.Tensor]:
    """Indices of TP rank r's part of layer ``layer``'s states: conv channels ``[q | k | v]`` of its
    q/k heads and their value heads, its value heads, its K/V heads."""
    config = model.config
    if config.layer_types[layer] == "linear_attention":
        hk, hv = config.linear_num_key_heads // tp, config.linear_num_value_heads // tp
        dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
        kd = config.linear_num_key_heads * dk
        q = torch.arange(r * hk * dk, (r + 1) * hk * dk)
        v = 2 * kd + torch.arange(r * hv * dv, (r + 1) * hv * dv)
        return {"conv": torch.cat([q, kd + q, v]), "heads": torch.arange(r * hv, (r + 1) * hv)}
    kv = config.num_key_value_heads // tp
    return {"heads": torch.arange(r * kv, (r + 1) * kv)}


def _state_errors(model: Any, mesh: Any, cache: Any, whole_cache: Any, label: str) -> dict[str, float]:
    """This TP rank's cache against its heads' slice of a one-device cache, by state."""
    tp, r, errors = mesh.size("tp"), mesh.get_local_rank("tp"), {}
    for i in range(len(model.model.layers)):
        mine, whole, rows = cache.layers[i], whole_cache.layers[i], _local_rows(model, i, tp, r)
        if "conv" in rows:
            errors[f"{label}conv{i}"] = _rel(mine.conv_states[0], whole.conv_states[0][:, rows["conv"]])
            errors[f"{label}recurrent{i}"] = _rel(
                mine.recurrent_states[0], whole.recurrent_states[0][:, rows["heads"]]
            )
        else:
            errors[f"{label}k{i}"] = _rel(mine.keys, whole.keys[:, rows["heads"]])
            errors[f"{label}v{i}"] = _rel(mine.values, whole.values[:, rows["heads"]])
    return errors


def _dense_case(mesh: Any, ref: dict[str, Any]) -> list[str]:
    cp_mesh = mesh["cp"]
    ids, failures = _prompt(), []
    model = apply_tensor_parallel(copy.deepcopy(ref["base"]), mesh["tp"])
    apply_context_parallel(model, cp_mesh, mode="p2p")
    packed_logits, caches = prefill_context_parallel(model, cp_mesh, ids[:1], cu_seqlens=torch.tensor(CU))
    logits, cache = prefill_context_parallel(model, cp_mesh, ids)
    undo_context_parallel(model)
    errors = {"logits": _rel(logits, ref["logits"]), **_state_errors(model, mesh, cache, ref["cache"], "")}
    for n, (alone_logits, alone_cache) in enumerate(ref["packed"]):
        errors[f"packed{n}/logits"] = _rel(packed_logits[n], alone_logits)
        errors.update(_state_errors(model, mesh, caches[n], alone_cache, f"packed{n}/"))
    failures += [f"dense {name}: relative error {e:.1e}" for name, e in errors.items() if not e <= STATE_TOL]
    expected = ref["expected"]
    with torch.no_grad():  # transformers' generate on the TP group, from the TP x CP cache
        first = logits.argmax(-1, keepdim=True)
        out = model.generate(
            torch.cat([ids, first], 1),
            cache=copy.deepcopy(cache),
            max_new_tokens=NEW_TOKENS - 1,
            do_sample=False,
        )
        if not torch.equal(out[:, T:], expected):
            failures.append(f"dense generate from the TP cache: {out[:, T:].tolist()} != {expected.tolist()}")
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)  # the TP model alone
        if not torch.equal(out[:, T:], expected):
            failures.append(f"dense generate of the TP model: {out[:, T:].tolist()} != {expected.tolist()}")
    state = shard_cache(model, cp_mesh, cache, length=T)
    got = greedy_continue_context_parallel(model, cp_mesh, logits, state, max_new_tokens=NEW_TOKENS)
    if not torch.equal(got, expected):
        failures.append(f"dense on the (cp, tp) group: {got.tolist()} != {expected.tolist()}")
    return failures


def _group_case(mesh: Any, ref: dict[str, Any], kind: str, mode: str, layout: str) -> list[str]:
    """Prefill at cp x tp, greedy continuation on the group, against the one-device tokens."""
    cp_mesh = mesh["cp"]
    ids = ref.get("ids", _prompt())
    model = apply_tensor_parallel(copy.deepcopy(ref["base"]), mesh["tp"])
    apply_context_parallel(model, cp_mesh, mode=mode, layout=layout)
    logits, cache = prefill_context_parallel(model, cp_mesh, ids)
    undo_context_parallel(model)
    state = shard_cache(model, cp_mesh, cache, length=ids.shape[1])
    got = greedy_continue_context_parallel(model, cp_mesh, logits, state, max_new_tokens=NEW_TOKENS)
    if torch.equal(got, ref["expected"]):
        return []
    return [f"{kind} {mode}/{layout} on the (cp, tp) group: {got.tolist()} != {ref['expected'].tolist()}"]


def _worker(rank: int, world: int, refs: dict[str, Any]) -> list[str]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    return [
        *_dense_case(mesh, refs["dense"]),
        *_group_case(mesh, refs["moe"], "moe", "scan", "head_tail"),
        *_group_case(mesh, refs["hybrid"], "hybrid", "ulysses", "contiguous"),
    ]


@pytest.mark.timeout(300)
def test_prefill_and_decoding_on_cp_tp_group_equal_one_device() -> None:
    refs = references()
    for rank, failures in enumerate(run_ranks(_worker, 4, refs, timeout_s=280)):
        assert not failures, f"rank {rank}:\n" + "\n".join(failures)
    assert len(set(refs["dense"]["expected"][0].tolist())) > 2, "a near-constant continuation tests little"
