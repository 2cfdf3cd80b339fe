"""The head rules of tensor parallelism beside context parallelism (no framework): what the TP
plan (:mod:`hyperpar_gdn.tensor_parallel`) and the CP checks ask of a GDN layer's heads."""

from __future__ import annotations

from hyperpar_gdn.ops.gdn.layer import LayerDims
from hyperpar_gdn.planning.plan import HEAD_MODES, head_split_error

__all__ = ["attention_head_error", "tensor_parallel_head_error"]


def tensor_parallel_head_error(
    dims: LayerDims, tp: int, *, cp: int = 1, mode: str | None = None
) -> str | None:
    """Why a GDN layer of global ``dims`` cannot run at tp (with ``mode`` over cp ranks), or None.

    Each TP rank takes whole q/k heads with their value heads: ``num_k_heads`` divisible by tp. A
    head-parallel CP mode (ulysses, ulysses_hidden) splits a TP rank's value heads again over cp:
    ``num_v_heads`` divisible by tp x cp."""
    if dims.num_k_heads % tp:
        return (
            f"num_k_heads={dims.num_k_heads} is not divisible by tp={tp}: tensor parallelism gives every "
            f"TP rank whole q/k heads with their value heads (num_v_heads={dims.num_v_heads}); use a tp "
            f"that divides {dims.num_k_heads}"
        )
    if mode in HEAD_MODES:
        return head_split_error(dims.num_v_heads // tp, dims.num_k_heads // tp, cp, mode, tp=tp)
    return None


def attention_head_error(heads: int, kv_heads: int, tp: int) -> str | None:
    """Why a softmax-attention layer of ``heads`` query and ``kv_heads`` K/V heads cannot split
    over tp, or None: the query heads divisible by tp, and tp dividing the K/V heads or a
    multiple of them (each rank then holds the one K/V head of its query heads)."""
    if heads % tp:
        return f"self_attn: num_attention_heads={heads} is not divisible by tp={tp}"
    if kv_heads % tp and tp % kv_heads:
        return (
            f"self_attn: num_key_value_heads={kv_heads} and tp={tp}: tp must divide the K/V heads or be "
            "a multiple of them (each rank then holds the one K/V head of its query heads)"
        )
    return None
