"""Causal softmax attention over global positions, and rotary embeddings, on any framework.

Written once against the platform's :class:`~hyperpar_gdn.platform.TensorOps`; the attention
layers (ours on torch and MindSpore, transformers' ``Qwen3_5Attention`` under context
parallelism) hold their weights and call these: :func:`project_attention` (q with its output
gate, k, v, q/k norms, RoPE), :func:`causal_attention`, :func:`finish_attention` (gate, o_proj).
RoPE angles come from :func:`rope_cos_sin` (numpy, fp32, as transformers computes them).

Legend: B batch, H query heads, Hkv key/value heads, Tq queries, Tk keys, D head dim,
R rotary dims (R <= D, even).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from hyperpar_gdn.ops.attention.blockwise import blockwise_attention
from hyperpar_gdn.ops.attention.segments import segment_attention
from hyperpar_gdn.ops.attention.visibility import (
    Tokens,
    block_map,
    check_tokens,
    visible_pairs,
    visible_segments,
)
from hyperpar_gdn.ops.gdn.varlen import doc_ids_from_cu_seqlens
from hyperpar_gdn.ops.projections import Projection
from hyperpar_gdn.platform import Tensor, TensorOps


def init_attention_dims(
    module: object,
    *,
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rope_theta: float,
    rotary_dim: int | None,
) -> None:
    """Check an attention layer's constructor arguments and set its dimension attributes
    (``rotary_dim`` None: the whole head is rotated), on a module of any framework."""
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    if head_dim % 2:
        raise ValueError(f"head_dim={head_dim} must be even for RoPE")
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary_dim={rotary_dim} must be even and in (0, head_dim={head_dim}]")
    module.hidden_size = hidden_size
    module.num_heads = num_heads
    module.num_kv_heads = num_kv_heads
    module.head_dim = head_dim
    module.rope_theta = rope_theta
    module.rotary_dim = rotary_dim


def rope_cos_sin(positions_T: np.ndarray, rotary_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin ``[T, R]`` (fp32 numpy) for integer positions ``[T]``: inverse frequencies
    ``theta ** -(2i / R)``, angles repeated for the two halves (as transformers' default RoPE)."""
    if rotary_dim % 2:
        raise ValueError(f"RoPE needs an even number of rotary dims; got rotary_dim={rotary_dim}")
    exponent = np.arange(0, rotary_dim, 2, dtype=np.float32) / np.float32(rotary_dim)
    inv_freq = (np.float32(1.0) / (np.float32(theta) ** exponent)).astype(np.float32)
    freqs_TR2 = np.asarray(positions_T).astype(np.float32)[:, None] * inv_freq[None, :]
    emb_TR = np.concatenate([freqs_TR2, freqs_TR2], axis=-1)
    return np.cos(emb_TR), np.sin(emb_TR)


def project_attention(
    xp: TensorOps,
    x_BTC: Tensor,
    *,
    head_dim: int,
    q_proj: Projection,
    k_proj: Projection,
    v_proj: Projection,
    q_norm: Projection,
    k_norm: Projection,
    cos: Tensor,
    sin: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x ``[B, T, C]`` -> q ``[B, H, T, D]``, k and v ``[B, Hkv, T, D]`` (q and k normed per head
    and rotated by RoPE), output gate ``[B, T, H*D]``. ``q_proj`` gives ``[q | gate]`` per head;
    cos and sin ``[T, R]`` or ``[B, 1, T, R]``."""
    b, t, _ = x_BTC.shape
    d = head_dim
    q_gate = q_proj(x_BTC).reshape(b, t, -1, 2 * d)
    h = q_gate.shape[2]
    q_BHTD = xp.swapaxes(q_norm(q_gate[..., :d]), 1, 2)
    k_BHTD = xp.swapaxes(k_norm(k_proj(x_BTC).reshape(b, t, -1, d)), 1, 2)
    v_BHTD = xp.swapaxes(v_proj(x_BTC).reshape(b, t, -1, d), 1, 2)
    q_BHTD = apply_rotary(xp, q_BHTD, cos, sin)
    k_BHTD = apply_rotary(xp, k_BHTD, cos, sin)
    return q_BHTD, k_BHTD, v_BHTD, q_gate[..., d:].reshape(b, t, h * d)


def finish_attention(xp: TensorOps, o_BTX: Tensor, gate_BTX: Tensor, o_proj: Projection) -> Tensor:
    """Sigmoid output gate, then ``o_proj``: ``[B, T, H*D]`` -> ``[B, T, C]``."""
    return o_proj(o_BTX * xp.sigmoid(gate_BTX))


def rotate_half(xp: TensorOps, x: Tensor) -> Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dim (halves of its size)."""
    half = x.shape[-1] // 2
    return xp.cat([-x[..., half:], x[..., :half]], -1)


def apply_rotary(xp: TensorOps, x_BHTD: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first R dims of every head by the angles of its token (partial rotary when R < D).

    x ``[B, H, T, D]``; cos and sin ``[T, R]`` or ``[B, 1, T, R]`` (anything that broadcasts to
    ``[B, H, T, R]``)."""
    r = cos.shape[-1]
    d = x_BHTD.shape[-1]
    if r > d or r % 2:
        raise ValueError(f"rotary dims R={r} must be even and at most the head dim D={d}")
    if r == d:
        return x_BHTD * cos + rotate_half(xp, x_BHTD) * sin
    x_rot, x_pass = x_BHTD[..., :r], x_BHTD[..., r:]
    return xp.cat([x_rot * cos + rotate_half(xp, x_rot) * sin, x_pass], -1)


ATTENTION_PATHS = ("auto", "reference", "blockwise", "fused")
BLOCK_SIZE = 512  # query and key block of the blockwise path


def attention_path() -> str:
    """The path that ``HP_ATTENTION`` forces: ``auto`` (default: a fused kernel of the platform
    where it has one for the tensors, else ``blockwise``), ``reference`` (the dense
    :func:`dense_attention`), ``blockwise`` or ``fused`` (an error where there is no kernel)."""
    value = os.environ.get("HP_ATTENTION", "").strip().lower() or "auto"
    if value not in ATTENTION_PATHS:
        raise ValueError(
            f"HP_ATTENTION={os.environ['HP_ATTENTION']!r} is not an attention path; valid values are "
            f"{', '.join(ATTENTION_PATHS)}"
        )
    return value


def attention(
    xp: TensorOps,
    q_BHTD: Tensor,
    k_BHTD: Tensor,
    v_BHTD: Tensor,
    *,
    queries: Tokens,
    keys: Tokens,
    key_mask: Any = None,
    path: str | None = None,
    block_size: int = BLOCK_SIZE,
) -> Tensor:
    """Causal softmax attention over global positions -> ``[B, H, Tq, D]`` (scale ``D**-0.5``).

    Query i sees key j when ``keys.positions[j] <= queries.positions[i]``, both are in the same
    document (``docs``, packed documents) and ``key_mask[b, j]`` is not 0 (padding); a query that
    sees no key gives zeros. Queries and keys may be any tokens of the sequence (a shard, two
    fragments of a load-balanced layout, all-gathered keys in any order): only their positions
    and documents decide what is visible.

    Args:
        q_BHTD: ``[B, H, Tq, D]``; k_BHTD, v_BHTD: ``[B, Hkv, Tk, D]`` (H a multiple of Hkv; query
            head h reads KV head ``h // (H / Hkv)``).
        queries, keys: :class:`Tokens` of Tq and Tk tokens.
        key_mask: ``[B, Tk]`` (tensor or numpy; 1 = token, 0 = padding) or None.
        path: ``auto``, ``reference``, ``blockwise`` or ``fused`` (default: ``HP_ATTENTION``,
            see :func:`attention_path`).
        block_size: query and key block of the blockwise path.

    Example:
        >>> o = attention(xp, q, k, v, queries=Tokens.span(4, 8), keys=Tokens.span(0, 8))
    """
    b, h, tq, d = q_BHTD.shape
    hkv, tk = k_BHTD.shape[1], k_BHTD.shape[2]
    if h % hkv:
        raise ValueError(f"query heads H={h} must be a multiple of key/value heads Hkv={hkv}")
    if tuple(v_BHTD.shape) != tuple(k_BHTD.shape) or k_BHTD.shape[0] != b or k_BHTD.shape[3] != d:
        raise ValueError(
            f"k and v must both be [B={b}, Hkv, Tk, D={d}]; got k {tuple(k_BHTD.shape)}, v {tuple(v_BHTD.shape)}"
        )
    check_tokens(queries, keys, tq=tq, tk=tk)
    mask_np = None
    if key_mask is not None:
        mask_np = np.asarray(xp.to_numpy(key_mask) if xp.is_tensor(key_mask) else key_mask)
        if mask_np.shape != (b, tk):
            raise ValueError(f"key_mask must be [B, Tk] = {(b, tk)}; got {tuple(mask_np.shape)}")
    if block_size < 1:
        raise ValueError(f"block_size={block_size} must be >= 1")
    path = attention_path() if path is None else path
    if path not in ATTENTION_PATHS:
        raise ValueError(
            f"path={path!r} is not an attention path; valid values are {', '.join(ATTENTION_PATHS)}"
        )
    lowered = xp.autocast_dtype(q_BHTD)  # under bf16 autocast q, k, v meet in bf16, as in SDPA
    if lowered is not None:
        q_BHTD, k_BHTD, v_BHTD = (xp.cast(x, lowered) for x in (q_BHTD, k_BHTD, v_BHTD))
    if path == "reference":
        return dense_attention(xp, q_BHTD, k_BHTD, v_BHTD, queries=queries, keys=keys, key_mask=mask_np)
    kernel = xp.attention_kernel(q_BHTD) if path in ("auto", "fused") else None
    segments = visible_segments(queries, keys, mask_np) if kernel is not None else None
    if segments is not None:
        return segment_attention(xp, kernel, q_BHTD, k_BHTD, v_BHTD, segments)
    if path == "fused":
        why = "padding that differs between batch rows" if kernel is not None else "these tensors"
        raise ValueError(f"attention path 'fused': the platform {xp.name!r} has no fused kernel for {why}")
    blocks = block_map(queries, keys, mask_np, block_q=block_size, block_k=block_size)
    return blockwise_attention(xp, q_BHTD, k_BHTD, v_BHTD, blocks)


def dense_attention(
    xp: TensorOps,
    q_BHTD: Tensor,
    k_BHTD: Tensor,
    v_BHTD: Tensor,
    *,
    queries: Tokens,
    keys: Tokens,
    key_mask: np.ndarray | None = None,
) -> Tensor:
    """The readable reference of :func:`attention` (same arguments, key_mask numpy): the whole
    ``[B, H, Tq, Tk]`` score matrix with a ``[B or 1, 1, Tq, Tk]`` mask -> ``[B, H, Tq, D]``."""
    h, hkv = q_BHTD.shape[1], k_BHTD.shape[1]
    k_BHTD = xp.repeat_interleave(k_BHTD, h // hkv, 1)
    v_BHTD = xp.repeat_interleave(v_BHTD, h // hkv, 1)
    visible = visible_pairs(queries, keys, key_mask)[:, None]
    visible = xp.constant(visible.astype(np.int64), like=xp.arange(1, like=q_BHTD)) != 0
    return xp.masked_attention(q_BHTD, k_BHTD, v_BHTD, visible)


def causal_attention(
    xp: TensorOps,
    q_BHTD: Tensor,
    k_BHTD: Tensor,
    v_BHTD: Tensor,
    *,
    q_offset: int,
    key_mask: Tensor | None = None,
    doc_ids: Tensor | None = None,
) -> Tensor:
    """Causal softmax attention of a contiguous run of queries -> ``[B, Tq, H*D]``.

    Query i sits at global position ``q_offset + i``; keys are positions ``0 .. Tk-1``;
    ``key_mask`` ``[B, Tk]`` padding; ``doc_ids`` int ``[1, Tk]`` the document of every key
    (queries take theirs at their positions). :func:`attention` with those :class:`Tokens`.

    Args:
        q_BHTD: ``[B, H, Tq, D]``; k_BHTD, v_BHTD: ``[B, Hkv, Tk, D]`` (H a multiple of Hkv).
    """
    b, h, tq, d = q_BHTD.shape
    tk = k_BHTD.shape[2]
    if not 0 <= q_offset <= tk - tq:
        raise ValueError(
            f"queries at positions [{q_offset}, {q_offset + tq}) need keys up to position "
            f"{q_offset + tq - 1}, but there are Tk={tk} keys"
        )
    docs = None
    if doc_ids is not None:
        if tuple(doc_ids.shape) != (1, tk):
            raise ValueError(f"doc_ids must be [1, Tk] = {(1, tk)}; got {tuple(doc_ids.shape)}")
        docs = np.asarray(xp.to_numpy(doc_ids)).reshape(tk).astype(np.int64)
    queries = Tokens.span(q_offset, q_offset + tq, None if docs is None else docs[q_offset : q_offset + tq])
    keys = Tokens.span(0, tk, docs)
    o_BHTD = attention(xp, q_BHTD, k_BHTD, v_BHTD, queries=queries, keys=keys, key_mask=key_mask)
    return xp.permute(o_BHTD, (0, 2, 1, 3)).reshape(b, tq, h * d)


def doc_ids_tensor(xp: TensorOps, cu_seqlens: Any, *, seq_len: int, like: Tensor) -> Tensor:
    """The document of every token, int64 ``[1, T]`` on ``like``'s device, from packed
    documents' ``cu_seqlens`` (int ``[N+1]``, validated against T)."""
    ids = doc_ids_from_cu_seqlens(cu_seqlens, seq_len=seq_len)
    return xp.constant(ids.reshape(1, seq_len), like=xp.arange(1, like=like))


def self_attention(
    xp: TensorOps, q_BHTD: Tensor, k_BHTD: Tensor, v_BHTD: Tensor, *, cu_seqlens: Any = None
) -> Tensor:
    """Causal attention of a whole sequence on one device -> ``[B, T, H*D]``; with
    ``cu_seqlens`` (packed documents, B = 1) each document attends only to itself."""
    b, t = q_BHTD.shape[0], q_BHTD.shape[2]
    doc_ids = None
    if cu_seqlens is not None:
        if b != 1:
            raise ValueError(f"packed documents (cu_seqlens) need batch size B=1; got B={b}")
        doc_ids = doc_ids_tensor(xp, cu_seqlens, seq_len=t, like=q_BHTD)
    return causal_attention(xp, q_BHTD, k_BHTD, v_BHTD, q_offset=0, doc_ids=doc_ids)
