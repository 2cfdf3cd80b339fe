"""The rules of tensor parallelism, once and framework-free: which rows and heads TP rank t of tp
owns, and when a layer splits at all.

Every rule gives global indices (numpy ``int64`` arrays) into a parameter of the single-device
layer; torch's styles (:mod:`hyperpar_gdn.tensor_parallel.styles`), MindSpore's
(:mod:`hyperpar_gdn.tensor_parallel.mindspore_styles`), the row orders of a ``--tp`` run's
checkpoints (:mod:`hyperpar_gdn.train.row_orders`) and the memory estimate
(:mod:`.rank_shape`) read them here.

- GDN layer (:func:`gdn_parts`): rank t holds q/k heads ``[t hk, (t+1) hk)`` (hk = Hk / tp) with
  their value heads ``[t hv, (t+1) hv)``: those heads' rows of ``in_proj_qkv`` and ``conv1d``
  (in the ``[q | k | v]`` order of a layer of hk and hv heads), of ``in_proj_z``, and by value head
  of ``in_proj_a``, ``in_proj_b``, ``A_log``, ``dt_bias``; ``out_proj``'s input columns of its
  value heads. The gated norm's weight stays whole. In the grouped order
  (:func:`qkv_grouped_order`: per q/k head its q rows, k rows and value rows together) rank t's
  rows are the t-th of tp equal blocks, whatever tp: the order torch's ``DTensor`` shards and a
  sharded checkpoint keep, :func:`qkv_local_order` putting a block back in ``[q | k | v]`` order.
- attention (:func:`attention_parts`): query heads ``[t h, (t+1) h)`` (h = heads / tp): their rows
  of ``q_proj`` (query and output gate of each head) and ``o_proj``'s input columns; the K/V heads
  ``[t kv, (t+1) kv)`` of ``k_proj``/``v_proj`` when tp divides them, else (tp a multiple of them)
  every rank holds them whole and uses the one K/V head of its query heads (:func:`kv_head_of`).
- MLP (:func:`mlp_parts`): intermediate columns ``[t n, (t+1) n)`` (n = I / tp) of ``gate_proj`` and
  ``up_proj`` (rows) and ``down_proj`` (input columns); a MoE block's routed and shared experts
  alike, its router and the shared expert's gate whole. The experts' fused ``gate_up_proj``
  (``[E, 2I, C]``) is sharded in the interleaved order (:func:`gate_up_interleaved_order`: gate row
  u beside up row u), :func:`gate_up_local_order` putting a block back in ``[gate | up]`` order.
"""

from __future__ import annotations

import numpy as np

from hyperpar_gdn.ops.gdn.layer import LayerDims
from hyperpar_gdn.planning.plan import HEAD_MODES, head_split_error

__all__ = [
    "Parts",
    "attention_head_error",
    "attention_parts",
    "block",
    "gate_up_interleaved_order",
    "gate_up_local_order",
    "gdn_parts",
    "kv_head_of",
    "kv_heads_per_rank",
    "mlp_parts",
    "qkv_grouped_order",
    "qkv_local_order",
    "span",
    "tensor_parallel_head_error",
]

Parts = dict[str, tuple[int, np.ndarray]]  # parameter name -> (dim, global indices along it)


def span(start: int, count: int, width: int) -> np.ndarray:
    """Indices ``[start * width, (start + count) * width)``: ``count`` heads of ``width`` from head ``start``."""
    return np.arange(start * width, (start + count) * width)


def block(order: np.ndarray, tp: int, rank: int) -> np.ndarray:
    """The ``rank``-th of ``tp`` equal blocks of ``order`` (what a ``Shard`` of it holds)."""
    n = len(order) // tp
    return order[rank * n : (rank + 1) * n]


# --- the GDN layer -----------------------------------------------------------------------------------


def qkv_grouped_order(num_k_heads: int, head_k_dim: int, num_v_heads: int, head_v_dim: int) -> np.ndarray:
    """The canonical row (``[q | k | v]``) of each row of the grouped order: per q/k head h, its q
    rows, its k rows, then the v rows of its ``num_v_heads / num_k_heads`` value heads."""
    kd, group = num_k_heads * head_k_dim, (num_v_heads // num_k_heads) * head_v_dim
    rows = [
        np.concatenate(
            [
                span(h, 1, head_k_dim),
                kd + span(h, 1, head_k_dim),
                2 * kd + span(h, 1, group),
            ]
        )
        for h in range(num_k_heads)
    ]
    return np.concatenate(rows)


def qkv_local_order(dims: LayerDims, tp: int) -> np.ndarray:
    """A rank's block of the grouped order of a layer of global ``dims``, as positions in that
    block, in the ``[q | k | v]`` order of a layer of its hk and hv heads."""
    local = (dims.num_k_heads // tp, dims.head_k_dim, dims.num_v_heads // tp, dims.head_v_dim)
    return np.argsort(qkv_grouped_order(*local))


def gdn_parts(dims: LayerDims, tp: int, rank: int) -> Parts:
    """The rows (and ``out_proj``'s columns) of a GDN layer of global ``dims`` that TP rank
    ``rank`` of ``tp`` holds, each parameter's in the order of a one-device layer of its heads."""
    hk, hv = dims.num_k_heads // tp, dims.num_v_heads // tp
    q, v = span(rank * hk, hk, dims.head_k_dim), span(rank * hv, hv, dims.head_v_dim)
    qkv, heads = np.concatenate([q, dims.key_dim + q, 2 * dims.key_dim + v]), span(rank * hv, hv, 1)
    return {
        "in_proj_qkv.weight": (0, qkv),
        "conv1d.weight": (0, qkv),
        "in_proj_z.weight": (0, v),
        **{name: (0, heads) for name in ("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")},
        "out_proj.weight": (1, v),
    }


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


# --- softmax attention -------------------------------------------------------------------------------


def kv_heads_per_rank(kv_heads: int, tp: int) -> int:
    """The K/V heads a rank uses: its share when tp divides them, else the one of its query heads."""
    return kv_heads // tp if kv_heads % tp == 0 else 1


def kv_head_of(rank: int, kv_heads: int, tp: int) -> int | None:
    """The one K/V head rank ``rank`` uses when tp is a multiple of the K/V heads (the ranks of
    head j are ``j tp/Hkv .. (j+1) tp/Hkv - 1``), or None when it holds a share of them."""
    return None if kv_heads % tp == 0 else rank // (tp // kv_heads)


def attention_parts(heads: int, kv_heads: int, head_dim: int, tp: int, rank: int) -> Parts:
    """The rows of ``q_proj`` (query and gate per head), ``k_proj``/``v_proj`` (only when tp
    divides the K/V heads: else they stay whole) and the columns of ``o_proj`` that rank ``rank``
    of ``tp`` holds."""
    h = heads // tp
    parts = {
        "q_proj.weight": (0, span(rank * h, h, 2 * head_dim)),
        "o_proj.weight": (1, span(rank * h, h, head_dim)),
    }
    if kv_heads % tp == 0:
        kv = span(rank * (kv_heads // tp), kv_heads // tp, head_dim)
        parts |= {"k_proj.weight": (0, kv), "v_proj.weight": (0, kv)}
    return parts


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


# --- MLPs and experts --------------------------------------------------------------------------------


def mlp_parts(intermediate: int, tp: int, rank: int) -> Parts:
    """The intermediate columns of a SwiGLU MLP that rank ``rank`` of ``tp`` holds: ``gate_proj``
    and ``up_proj`` rows, ``down_proj`` input columns."""
    cols = span(rank, 1, intermediate // tp)
    return {"gate_proj.weight": (0, cols), "up_proj.weight": (0, cols), "down_proj.weight": (1, cols)}


def gate_up_interleaved_order(intermediate: int) -> np.ndarray:
    """The canonical row (gate rows ``[0, I)``, up rows ``[I, 2I)``) of each interleaved row."""
    return np.stack([np.arange(intermediate), intermediate + np.arange(intermediate)], 1).reshape(-1)


def gate_up_local_order(intermediate: int, tp: int) -> np.ndarray:
    """A rank's block of the interleaved order, as positions in that block, in ``[gate | up]``
    order of its I / tp columns."""
    return np.argsort(gate_up_interleaved_order(intermediate // tp))
