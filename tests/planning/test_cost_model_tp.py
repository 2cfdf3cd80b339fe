"""Tensor parallelism in the cost model: the TP bytes it predicts against what a real TP x CP run
all-reduces (4 gloo ranks), a TP rank priced as the layer on its heads, and the (tp, cp)
ranking ordered by its own terms."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from distributed_harness import run_ranks
from tiny_models import tiny_config

from hyperpar_gdn import (
    apply_context_parallel,
    apply_tensor_parallel,
    init_device_mesh,
    plan_context_parallel,
)
from hyperpar_gdn.distributed.parallelize import resolve_plan
from hyperpar_gdn.planning.cost_model import MACHINES
from hyperpar_gdn.planning.cost_model_tp import allreduce_seconds, tp_exchange_bytes
from hyperpar_gdn.planning.split_ranking import rank_tp_cp_splits
from hyperpar_gdn.tensor_parallel import count_tp_traffic

QWEN27B = {"num_k_heads": 16, "num_v_heads": 48, "head_k_dim": 128, "head_v_dim": 128, "hidden_size": 5120}
B, T = 2, 32


def _traffic_worker(rank: int, world: int) -> dict[str, object]:
    """cp 2 x tp 2 (mesh (cp, tp)), p2p, the MoE model with four GDN layers in fp32: the bytes
    count_tp_traffic counts per kind over a forward and backward; and what ``auto`` prices."""
    import transformers

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    out: dict[str, object] = {}
    torch.manual_seed(0)
    config = tiny_config(moe=True, layer_types=("linear_attention",) * 4)
    model = apply_tensor_parallel(transformers.Qwen3_5MoeForCausalLM(config).float(), mesh["tp"])
    ids = torch.randint(0, 61, (B, T), generator=torch.Generator().manual_seed(1))
    # auto prices the layer's global heads at the TP layer's tp
    out["plan"] = resolve_plan(model, mesh["cp"], mode="auto", seq_len=T, dtype="float32").reason
    apply_context_parallel(model, mesh["cp"], mode="p2p")
    shard = ids.view(B, 2, T // 2)[:, mesh["cp"].get_local_rank()]
    with count_tp_traffic() as traffic:
        model(input_ids=shard, use_cache=False).logits.square().sum().backward()
    out["moe"] = {k: traffic.bytes(k) for k in ("output", "input_grad", "param_grad")}
    return out


def test_tp_bytes_equal_what_a_tp_cp_run_counts() -> None:
    """The model's payload per GDN decoder layer x 4 layers equals the counted bytes, per kind
    (a MoE block's router and shared-expert gate among the parameters' gradients)."""
    for rank, counted in enumerate(run_ranks(_traffic_worker, 4, timeout_s=120)):
        reason = counted.pop("plan")
        assert "cp=2, H=4," in reason and "tp=2," in reason, (rank, reason)
        for name, kinds in counted.items():
            config = tiny_config(moe=name == "moe")
            predicted = tp_exchange_bytes(
                batch=B,
                tokens=T / 2,
                hidden=config.hidden_size,
                e=4,
                head_v_dim=config.linear_value_head_dim,
                num_experts=getattr(config, "num_experts", 0),
            )
            assert kinds == {k: 4 * v for k, v in predicted.items()}, (rank, name, kinds, predicted)
    ranked = plan_context_parallel(seq_len=T, cp=2, tp=2, dtype="float32", device="cpu", batch=B, **QWEN27B)
    assert ranked.ranking[0].tp_bytes == sum(
        tp_exchange_bytes(batch=B, tokens=T / 2, hidden=5120, e=4, head_v_dim=128).values()
    )


def test_a_tp_rank_is_priced_on_its_heads() -> None:
    """At tp the CP modes cost what they cost for the layer on H/tp heads with tp x fewer CP ranks
    per node; the TP all-reduces (4 rings of B T/cp C e, one of the gated norm's gradient) are
    added to every mode alike, so the choice stays the local layer's."""
    m = MACHINES["gpu"]
    tp, cp, t = 4, 16, 1 << 18
    ranked = plan_context_parallel(seq_len=t, cp=cp, tp=tp, inner_size=2, **QWEN27B)
    local = {**QWEN27B, "num_k_heads": 4, "num_v_heads": 12}
    alone = plan_context_parallel(
        seq_len=t, cp=cp, inner_size=2, devices_per_node=m.devices_per_node // tp, **local
    )
    assert [(c.mode, c.seconds) for c in ranked.ranking] == [(c.mode, c.seconds) for c in alone.ranking]
    block = t / cp * 5120 * 2
    ring = 4 * allreduce_seconds(block, tp, m.intra) + allreduce_seconds(128 * 4, tp, m.intra)
    assert all(c.tp_seconds == pytest.approx(ring) for c in ranked.ranking if c.feasible)
    with pytest.raises(ValueError, match="num_k_heads=16 is not divisible by tp=3"):
        plan_context_parallel(seq_len=t, cp=2, tp=3, **QWEN27B)


def _qwen27b() -> dict[str, object]:
    return dict(
        model_type="qwen3_5_text", vocab_size=248320, hidden_size=5120, intermediate_size=17408,
        num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
        linear_value_head_dim=128, full_attention_interval=4, tie_word_embeddings=False,
    )  # fmt: skip


@pytest.mark.parametrize("devices, seq_len", [(8, 1 << 17), (64, 1 << 20)])
def test_the_split_ranking_follows_its_terms(devices: int, seq_len: int) -> None:
    """Feasible splits within the budget first, each ordered by the sum of its terms; the tp
    that does not split the heads last with its reason; a free link inside the node removes the
    TP term; the memory per rank falls with cp (fewer tokens per rank)."""
    splits = rank_tp_cp_splits(_qwen27b(), devices=devices, seq_len=seq_len, budget_gib=120)
    ok = [s for s in splits if s.feasible]
    keys = [(not s.fits, s.layer_seconds) for s in ok]
    assert keys == sorted(keys)
    for s in ok:
        assert s.layer_seconds == s.cp_seconds + s.rule_seconds + s.tp_seconds + s.fsdp_seconds
        assert (s.tp_seconds == 0) == (s.tp == 1)
    assert all(not s.feasible and "does not split" in s.reason for s in splits[len(ok) :])
    assert {s.tp for s in ok} == {t for t in (1, 2, 4, 8) if devices % t == 0}
    gpu = MACHINES["gpu"]
    for s in ok:  # at cp 1 the only CP-side cost: H/tp heads below saturating_heads starve the kernel
        if s.cp == 1:
            starved = s.rule_seconds * (gpu.flops / gpu.rate(48 / s.tp) - 1)
            assert s.cp_seconds == pytest.approx(starved) and s.cp_seconds > 0
    with pytest.raises(ValueError, match="seq_len must be an int >= 1; got 0"):
        rank_tp_cp_splits(_qwen27b(), devices=devices, seq_len=0)
    free = rank_tp_cp_splits(_qwen27b(), devices=devices, seq_len=seq_len, bandwidth=1e30, latency=0.0)
    by_tp = {s.tp: s for s in free if s.feasible}
    for s in ok:  # a free link inside the node: no TP time, the same rule work
        assert by_tp[s.tp].tp_seconds == pytest.approx(0, abs=1e-12)
        assert by_tp[s.tp].rule_seconds == s.rule_seconds
    ranked = sorted(ok, key=lambda s: s.cp)
    memory = [s.memory_bytes for s in ranked]
    assert memory[-1] < memory[0], memory  # more CP ranks, fewer tokens per rank
    one = dataclasses.replace(ok[0])
    assert one.describe().startswith(f"tp {one.tp} x cp {one.cp}")
