"""``bench_scale``'s (ep, cp, tp) part: the cost model's ranking of expert- x context- x
tensor-parallel splits.

:func:`split_rows`: for Qwen3.5-27B and the MoE models Qwen3.5-397B-A17B, -122B-A10B and
-35B-A3B (:data:`MODELS`, whole-model sizes) at :data:`SPLIT_TOKENS` over :data:`SPLIT_DEVICES`
devices on the ``gpu`` and ``npu`` machines, ``rank_tp_cp_splits``' ranking (bf16, FSDP over the
dp x cp ranks, activation checkpointing, contiguous layout, dp = 1 and so ep dividing cp; memory
budget :data:`BUDGET_GIB` per device): every split's terms per GDN decoder layer and memory per
rank, the best split and the mode ``auto`` picks for it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BUDGET_GIB", "MODELS", "SPLIT_DEVICES", "SPLIT_TOKENS", "split_rows"]

# The models' sizes (transformers' Qwen3.5 names), from public copies of their config.json (122B-A10B's
# from its published architecture, not checked against a config.json; they give 122.1B parameters): 27B
# dense (hidden 5120, 64 layers, FFN 17408, 24 query heads and 4 K/V heads of 256); 397B-A17B MoE
# (hidden 4096, 60 layers, 512 experts of 1024 with 10 per token and a shared expert of 1024, 32
# query heads and 2 K/V heads of 256); 122B-A10B MoE (hidden 3072, 48 layers, 256 experts of 1024
# with 8 per token and a shared expert of 1024, 32 query heads and 2 K/V heads of 256, 64 GDN
# value heads); 35B-A3B MoE (hidden 2048, 40 layers, 256 experts of 512 with 8 per token and a
# shared expert of 512, 16 query heads and 2 K/V heads of 256, 32 GDN value heads); all a
# vocabulary of 248320, untied, GDN layers with 16 q/k heads of 128 (value heads of 128), every
# fourth layer softmax attention.
COMMON = {
    "vocab_size": 248320,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 4,
    "tie_word_embeddings": False,
}
MODELS = {
    "Qwen3.5-27B": COMMON
    | {"model_type": "qwen3_5_text", "hidden_size": 5120, "num_hidden_layers": 64}
    | {"intermediate_size": 17408, "num_attention_heads": 24, "num_key_value_heads": 4}
    | {"linear_num_value_heads": 48},
    "Qwen3.5-397B-A17B": COMMON
    | {"model_type": "qwen3_5_moe_text", "hidden_size": 4096, "num_hidden_layers": 60}
    | {"num_attention_heads": 32, "num_key_value_heads": 2, "linear_num_value_heads": 64}
    | {"num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 1024}
    | {"shared_expert_intermediate_size": 1024},
    "Qwen3.5-122B-A10B": COMMON
    | {"model_type": "qwen3_5_moe_text", "hidden_size": 3072, "num_hidden_layers": 48}
    | {"num_attention_heads": 32, "num_key_value_heads": 2, "linear_num_value_heads": 64}
    | {"num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 1024}
    | {"shared_expert_intermediate_size": 1024},
    "Qwen3.5-35B-A3B": COMMON
    | {"model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_hidden_layers": 40}
    | {"num_attention_heads": 16, "num_key_value_heads": 2, "linear_num_value_heads": 32}
    | {"num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512}
    | {"shared_expert_intermediate_size": 512},
}
SPLIT_TOKENS = (131072, 262144, 1048576)
SPLIT_DEVICES = (8, 16, 32, 64, 128, 256)
BUDGET_GIB = {"gpu": 80.0, "npu": 64.0}  # an H100/H800-class GPU, an Ascend 910B


def split_rows() -> list[dict[str, Any]]:
    """One row per (model, device, T, devices): ``ranking`` (every split's terms in seconds, its
    mode, memory per rank in GiB, whether it fits, or why it is not possible), ``best`` (the
    first split: its ep, tp, cp and the mode auto picks) and ``best_fits``."""
    from hyperpar_gdn.planning.split_ranking import rank_tp_cp_splits

    rows = []
    for model, config in MODELS.items():
        for device, budget in BUDGET_GIB.items():
            for t in SPLIT_TOKENS:
                for devices in SPLIT_DEVICES:
                    splits = rank_tp_cp_splits(
                        config, devices=devices, seq_len=t, device=device, budget_gib=budget
                    )
                    ranking = [_split(s) for s in splits]
                    best = splits[0]
                    rows.append(
                        {"model": model, "device": device, "seq_len": t, "devices": devices}
                        | {"budget_gib": budget, "ranking": ranking, "best_fits": best.fits}
                        | {"best": {"ep": best.ep, "tp": best.tp, "cp": best.cp, "mode": best.mode}}
                        | {"best_inner_size": best.inner_size}
                    )
    return rows


def _split(s: Any) -> dict[str, Any]:
    if not s.feasible:
        return {"ep": s.ep, "tp": s.tp, "cp": s.cp, "feasible": False, "reason": s.reason}
    return {
        "ep": s.ep,
        "tp": s.tp,
        "cp": s.cp,
        "feasible": True,
        "mode": s.mode,
        "inner_size": s.inner_size,
        "layer_seconds": s.layer_seconds,
        "cp_seconds": s.cp_seconds,
        "rule_seconds": s.rule_seconds,
        "tp_seconds": s.tp_seconds,
        "fsdp_seconds": s.fsdp_seconds,
        "ep_seconds": s.ep_seconds,
        "expert_seconds": s.expert_seconds,
        "tp_bytes": s.tp_bytes,
        "ep_bytes": s.ep_bytes,
        "state_bytes": s.state_bytes,
        "memory_gib": s.memory_bytes / 2**30,
        "fits": s.fits,
    }
