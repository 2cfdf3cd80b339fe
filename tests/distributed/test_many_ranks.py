"""Many ranks on one machine: a whole tiny transformers Qwen3.5 (three GDN layers of 8 value heads,
one softmax-attention layer; fp64) on 16 forked gloo ranks (one thread each, 8 tokens per rank,
chunks of 4), one process group running every case in sequence: p2p, all_gather, scan and two
levels (4 x 4), head_tail and contiguous, packed documents crossing ranks and nodes. Logits shard
and every parameter gradient (summed over the ranks) equal one device (the same model on one
rank) to 1e-10, but the weights of transformers' RMSNorms, which compute in fp32 (their gradient's
sum over tokens rounds at 1e-7 in another order: 1e-6); and transformers' model alone (each
document alone; its GDN gates in fp32) to 1e-5.

Per rank, every call into the process group is counted and timed (:mod:`collective_census`: a
wrapper of the torch.distributed calls the platform makes; the real collectives run) and split by
decoder layer. Asserted: each GDN layer's bytes, forward and backward, equal the cost model's
:func:`~hyperpar_gdn.planning.cost_model.rank_bytes_sent` to the byte on every rank; the
attention layer sends its keys and values' all-gather; p2p's critical path is 2 (n - 1) hops;
scan's first and last ranks send in ceil(log2 cp) rounds; all_gather's collectives priced as
rings are the model's messages; all_gather's gathered summaries grow with cp (the model's
summary memory), scan's largest message is one map. Printed with ``-s``, per case: bytes,
messages, rounds on a GDN layer's critical path beside the model's, the step's, the largest
state buffer, the seconds waited in collectives.

The same worker runs at 32 (8 x 4) and 64 (8 x 8) ranks when ``HYPERPAR_MANY_RANKS=32,64`` is
set (once, on a quiet machine: docs/benchmarks.md records the run); CI runs 16."""

from __future__ import annotations

import copy
import math
import os
import time
from dataclasses import dataclass

import pytest
import torch
from collective_census import Census, Event, critical_rounds
from distributed_harness import run_ranks
from tiny_models import tiny_model

from hyperpar_gdn import apply_context_parallel, init_device_mesh, shard_for_context_parallel
from hyperpar_gdn.distributed.layout import TokenLayout
from hyperpar_gdn.planning.cost_model import MACHINES, Geometry, mode_cost, rank_bytes_sent

TOL, NORM_TOL, HF_TOL, PER_RANK, VOCAB, HEADS = 1e-10, 1e-6, 1e-5, 8, 61, 8
FP32_NORMS = ("layernorm.weight", "q_norm.weight", "k_norm.weight", "model.norm.weight")
INNER = {16: 4, 32: 4, 64: 8}  # two levels: 4 x 4, 8 x 4, 8 x 8
DEADLINE = {16: 400, 32: 1800, 64: 3400}  # seconds; 32 and 64 ranks are run by hand (see above)
WORLDS = [16] + [int(w) for w in os.environ.get("HYPERPAR_MANY_RANKS", "").split(",") if w]
GDN_LAYERS, ATTENTION_LAYER = (0, 1, 2), 3  # tiny_config's layer types


@dataclass(frozen=True)
class Case:
    mode: str
    layout: str
    inner: int | None = None
    packed: bool = False

    @property
    def name(self) -> str:
        inner = "" if self.inner is None else f"/{self.inner}"
        return f"{self.mode}{inner}/{self.layout}" + ("/docs" if self.packed else "")


def _cases(world: int) -> list[Case]:
    inner = INNER[world]
    return [
        Case("p2p", "head_tail", packed=True),
        Case("p2p", "contiguous"),
        Case("all_gather", "head_tail"),
        Case("all_gather", "contiguous", packed=True),
        Case("scan", "contiguous", packed=True),
        Case("scan", "head_tail"),
        Case("ulysses+scan", "head_tail", inner, packed=True),
        Case("ulysses+p2p", "contiguous", inner),
        Case("ulysses+all_gather", "head_tail", inner),
    ]


def _documents(t: int) -> tuple[int, ...]:
    return (0, 5, t // 3, t // 3 + 1, t - 7, t)  # short documents, one across many ranks and nodes


def _inputs(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per case: token ids ``[1, T]`` and the logits' weights ``[1, T, vocab]`` (the loss)."""
    t = world * PER_RANK
    inputs = []
    for i, _ in enumerate(_cases(world)):
        gen = torch.Generator().manual_seed(i)
        ids = torch.randint(0, VOCAB, (1, t), generator=gen)
        inputs.append((ids, torch.randn(1, t, VOCAB, generator=gen, dtype=torch.float64)))
    return inputs


def _transformers(base: torch.nn.Module, world: int) -> list[dict[str, torch.Tensor]]:
    """transformers' model alone, per case (a packed row: each document alone): logits and every
    parameter gradient."""
    refs = []
    for case, (ids, weight) in zip(_cases(world), _inputs(world), strict=True):
        model = copy.deepcopy(base)
        cuts = _documents(ids.shape[1]) if case.packed else (0, ids.shape[1])
        spans = zip(cuts[:-1], cuts[1:], strict=True)
        pieces = [model(input_ids=ids[:, a:b], use_cache=False).logits for a, b in spans]
        logits = torch.cat(pieces, 1)
        (logits * weight).sum().backward()
        refs.append({"logits": logits.detach()} | {n: p.grad for n, p in model.named_parameters()})
    return refs


def _run(
    mesh: object, base: torch.nn.Module, case: Case, ids: torch.Tensor, weight: torch.Tensor, census: Census
) -> dict[str, torch.Tensor]:
    """``case`` on this rank of ``mesh``: the logits shard and every parameter gradient summed
    over the ranks; the step's collectives counted by ``census``."""
    rank, world = mesh.get_local_rank(), mesh.size()
    index = torch.as_tensor(TokenLayout.of(case.layout, [ids.shape[1] // world] * world).positions(rank))
    docs = {"cu_seqlens": torch.tensor(_documents(ids.shape[1]))} if case.packed else {}
    shard = shard_for_context_parallel(mesh, ids, layout=case.layout, **docs)
    model = apply_context_parallel(
        copy.deepcopy(base), mesh, mode=case.mode, layout=case.layout, inner_size=case.inner, chunk_size=4
    )
    handles = census.mark_layers(model.model.layers)
    with census.installed():
        census.mark("model")
        logits = model(**shard.model_inputs(), use_cache=False).logits
        (logits * weight[:, index]).sum().backward()
    for handle in handles:
        handle.remove()
    got = {"logits": logits.detach()}
    for n, p in model.named_parameters():
        got[n] = mesh.platform.collectives.all_reduce_sum(p.grad.clone(), mesh.get_group())
    return got


def _one_device(rank: int, world: int, base: torch.nn.Module, cases: list[Case], inputs: list) -> list[dict]:
    """The same model on one rank (no CP: the library's one-device GDN), per case."""
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))
    return [
        _run(mesh, base, Case("p2p", "contiguous", packed=case.packed), ids, weight, Census())
        for case, (ids, weight) in zip(cases, inputs, strict=True)
    ]


def _fp32_norm(name: str) -> bool:
    """transformers' RMSNorm weights (its norms compute in fp32, whatever the model's dtype)."""
    return name.endswith(FP32_NORMS)


def _worst(
    got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], index: torch.Tensor, *, norms: bool = False
) -> float:
    """The largest relative error over ``got`` (the fp32 norms' weight gradients only, or all but
    them)."""
    worst = 0.0
    for key, value in got.items():
        if _fp32_norm(key) != norms:
            continue
        expected = ref[key][:, index] if key == "logits" else ref[key]
        worst = max(worst, ((value - expected).abs().max() / ref[key].abs().max()).item())
    return worst


def _worker(rank: int, world: int, base: torch.nn.Module, refs: list, hf_refs: list) -> dict[str, dict]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    out = {}
    for case, ref, hf, (ids, weight) in zip(_cases(world), refs, hf_refs, _inputs(world), strict=True):
        census = Census()
        got = _run(mesh, base, case, ids, weight, census)
        index = torch.as_tensor(TokenLayout.of(case.layout, [PER_RANK] * world).positions(rank))
        out[case.name] = {
            "error": _worst(got, ref, index),
            "norm_error": _worst(got, ref, index, norms=True),
            "hf_error": max(_worst(got, hf, index), _worst(got, hf, index, norms=True)),
            "events": census.events,
            "wait_s": sum(census.wait_s.values()),
        }
    return out


def _geometry(world: int, case: Case) -> Geometry:
    """The tiny model's GDN layer as the cost model takes it: 2 key and 8 value heads of 8, conv
    4, fp64 inputs and states."""
    return Geometry(
        world * PER_RANK, world, 2, HEADS, 8, 8, 4, 1, 8, head_tail=case.layout == "head_tail", s=8
    )


def _layer(events: list[Event], i: int) -> list[Event]:
    return [e for e in events if e.segment in (f"fwd{i}", f"bwd{i}")]


def _sent(events: list[Event]) -> int:
    return sum(e.nbytes for e in events)


def _messages(events: list[Event]) -> int:
    """Messages a rank starts: each send, each collective once."""
    return sum(len(e.sends) if e.op in ("send", "batch") else 1 for e in events)


def _check_case(world: int, case: Case, results: list[dict]) -> dict[str, object]:
    """Every rank's counts of one case against the cost model; the figures of the summary line."""
    g = _geometry(world, case)
    cost = mode_cost(case.mode, g, MACHINES["cpu"], inner_size=case.inner)
    logs = [r[case.name]["events"] for r in results]
    for rank, events in enumerate(logs):
        predicted = rank_bytes_sent(case.mode, g, rank, inner_size=case.inner)
        for i in GDN_LAYERS:
            sent = _sent(_layer(events, i))
            assert sent == predicted, (
                f"cp={world} {case.name} rank {rank} GDN layer {i}: {sent} != {predicted}"
            )
        # softmax attention: keys and values [B, 2 Hkv, T/cp, D] gathered, their gradient back
        kv = 2 * 2 * PER_RANK * 16 * 8
        attention = _sent(_layer(events, ATTENTION_LAYER))
        assert attention == 2 * kv * (world - 1), f"cp={world} {case.name} rank {rank}: attention {attention}"
        # outside the layers, once per forward: the shard lengths (an int64 per rank), then the
        # whole sequence's description (positions, padding, tokens)
        outside = [(e.op, e.nbytes) for e in events if e.segment == "model"]
        assert len(outside) == 2 and outside[0] == ("all_gather", 8 * (world - 1)), outside
        assert outside[1][0] == "all_gather", outside
        assert {e.segment for e in events} <= {"model"} | {
            f"{d}{i}" for d in ("fwd", "bwd") for i in range(4)
        }
    layer = [_layer(events, GDN_LAYERS[0]) for events in logs]
    return {
        "rounds": max(critical_rounds(layer)),
        "ring_rounds": max(critical_rounds(layer, weight=lambda size: size - 1)),
        "model_rounds": cost.messages,
        "step_rounds": max(critical_rounds(logs)),
        "bytes": [_sent(e) for e in layer],
        "messages": [_messages(e) for e in layer],
        "held": [max((e.filled for e in _state_exchanges(events)), default=0) for events in layer],
        "model_held": cost.summary_bytes,
        "forward_sends": [_state_sends(ev, "fwd", case.layout) for ev in layer],
        "backward_sends": [_state_sends(ev, "bwd", case.layout) for ev in layer],
        "wait_s": [r[case.name]["wait_s"] for r in results],
    }


def _state_sends(events: list[Event], phase: str, layout: str) -> int:
    """The messages a GDN layer's state exchange sends in ``phase`` (``fwd``, ``bwd``): its
    point-to-point rounds, past the conv halo's exchange (the first exchange of the forward; in
    the contiguous layout a point-to-point round, the last one of the backward)."""
    rest = [e for e in events if e.segment.startswith(phase) and e.op != "all_to_all"]
    rest = rest[1:] if phase == "fwd" else rest[:-1] if layout == "contiguous" else rest
    return sum(len(e.sends) for e in rest if e.op in ("send", "batch"))


def _state_exchanges(events: list[Event]) -> list[Event]:
    """A GDN layer's forward exchanges of states and summaries: past ulysses' all-to-alls and the
    conv halo's exchange (the first of the rest)."""
    rest = [e for e in events if e.segment.startswith("fwd") and e.op != "all_to_all"]
    return rest[1:]


@pytest.mark.timeout(3600)
@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"cp{w}")
def test_many_ranks_match_one_device(world: int) -> None:
    start = time.perf_counter()
    base = tiny_model(moe=False, num_v_heads=HEADS)
    refs = run_ranks(_one_device, 1, base, _cases(world), _inputs(world), timeout_s=300)[0]
    hf_refs = _transformers(base, world)
    results = run_ranks(
        _worker, world, base, refs, hf_refs, timeout_s=DEADLINE[world], pg_timeout_s=30 + 4 * (world - 16)
    )
    wall = time.perf_counter() - start
    summary = {}
    for case in _cases(world):
        for rank, result in enumerate(results):
            err, hf = result[case.name]["error"], result[case.name]["hf_error"]
            assert err <= TOL, f"cp={world} rank {rank} {case.name}: relative error {err:.2e} > {TOL:.0e}"
            norm = result[case.name]["norm_error"]
            assert norm <= NORM_TOL, f"cp={world} rank {rank} {case.name}: RMSNorm weights {norm:.2e}"
            assert hf <= HF_TOL, f"cp={world} rank {rank} {case.name}: against transformers {hf:.2e}"
        summary[case.name] = _check_case(world, case, results)
    _check_rounds_and_memory(world, summary)
    print(
        f"\ncp={world}: every case equals one device (worst {_worst_of(results, 'error'):.1e}; transformers' "
        f"model alone: {_worst_of(results, 'hf_error'):.1e}); {wall:.0f} s wall. Per rank and GDN layer, "
        "forward and backward: bytes sent (= the cost model's), messages, rounds on the critical path "
        "(a collective 1, or g - 1 as a ring) beside the model's messages in sequence, the largest state "
        "buffer beside the model's summary memory; the step's rounds and seconds waited in collectives"
    )
    print(
        f"{'case':<32} {'bytes sent':>17} {'msgs':>4} {'rounds':>6} {'ring':>4} {'model':>5} "
        f"{'step':>4} {'held B':>7} {'model B':>7} {'wait s max/mean':>15}"
    )
    for name, s in summary.items():
        print(
            f"{name:<32} {min(s['bytes']):>8}-{max(s['bytes']):<8} {max(s['messages']):>4} {s['rounds']:>6} "
            f"{s['ring_rounds']:>4} {s['model_rounds']:>5.0f} {s['step_rounds']:>4} {max(s['held']):>7} "
            f"{s['model_held']:>7.0f} {max(s['wait_s']):>7.2f}/{sum(s['wait_s']) / world:<7.2f}"
        )


def _check_rounds_and_memory(world: int, summary: dict[str, dict]) -> None:
    """p2p's critical path is its chain's 2 (n - 1) hops (the conv halo's exchange overlaps it;
    the model adds it: 2 messages, or in head_tail an all-gather ring and its reduce-scatter of
    2 (cp - 1) steps); scan's first and last ranks send in ceil(log2 cp) rounds; all_gather's
    collectives priced as rings are the model's messages in both layouts; all_gather's summaries
    held grow with cp (the model's n maps), scan's largest message does not (one map)."""
    for layout, n, halo in (("head_tail", 2 * world, 2 * (world - 1)), ("contiguous", world, 2)):
        p2p = next(s for name, s in summary.items() if name.startswith(f"p2p/{layout}"))
        assert p2p["rounds"] == 2 * (n - 1) == p2p["model_rounds"] - halo, p2p
        gathered = next(s for name, s in summary.items() if name.startswith(f"all_gather/{layout}"))
        assert gathered["ring_rounds"] == gathered["model_rounds"], gathered
    rounds = math.ceil(math.log2(world))
    scan = summary["scan/contiguous/docs"]
    assert scan["forward_sends"][0] == rounds == scan["backward_sends"][-1], scan
    assert max(scan["forward_sends"] + scan["backward_sends"]) == rounds, scan
    gathered = summary["all_gather/contiguous/docs"]
    one = 8 * HEADS * 8 * (8 + 8)  # one packed map [S | M] per rank: 8 heads, K = V = 8, fp64
    assert gathered["held"] == [world * one] * world == [gathered["model_held"]] * world, gathered["held"]
    assert summary["all_gather/head_tail"]["held"] == [2 * world * one] * world
    assert max(scan["held"]) == one == max(summary["scan/head_tail"]["held"]), scan["held"]


def _worst_of(results: list[dict], key: str) -> float:
    return max(v[key] for r in results for v in r.values())
