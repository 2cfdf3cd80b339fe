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

from collections.abc import Callable
from typing import Any

import numpy as np

from hyperpar_gdn.ops.varlen import doc_ids_from_cu_seqlens
from hyperpar_gdn.platform import Tensor, TensorOps

Projection = Callable[[Tensor], Tensor]


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
    """Causal softmax attention -> ``[B, Tq, H*D]`` (scale ``D**-0.5``).

    Query i sits at global position ``q_offset + i`` and sees keys ``j <= q_offset + i`` (keys
    are positions ``0 .. Tk-1``) where ``key_mask`` ``[B, Tk]`` (1 = token, 0 = padding) is not 0
    and, for packed documents, of its own document (``doc_ids`` int ``[1, Tk]``: the document of
    every key; queries take theirs at their positions). A query that sees no key (left padding)
    gives zeros.

    Args:
        q_BHTD: ``[B, H, Tq, D]``; k_BHTD, v_BHTD: ``[B, Hkv, Tk, D]`` (H a multiple of Hkv).
    """
    b, h, tq, d = q_BHTD.shape
    tk, hkv = k_BHTD.shape[2], k_BHTD.shape[1]
    if not 0 <= q_offset <= tk - tq:
        raise ValueError(
            f"queries at positions [{q_offset}, {q_offset + tq}) need keys up to position "
            f"{q_offset + tq - 1}, but there are Tk={tk} keys"
        )
    if h % hkv:
        raise ValueError(f"query heads H={h} must be a multiple of key/value heads Hkv={hkv}")
    if key_mask is not None and tuple(key_mask.shape) != (b, tk):
        raise ValueError(f"key_mask must be [B, Tk] = {(b, tk)}; got {tuple(key_mask.shape)}")
    k_BHTD = xp.repeat_interleave(k_BHTD, h // hkv, 1)
    v_BHTD = xp.repeat_interleave(v_BHTD, h // hkv, 1)
    q_pos = xp.arange(tq, like=q_BHTD) + q_offset
    visible = (xp.arange(tk, like=q_BHTD).reshape(1, tk) <= q_pos.reshape(tq, 1)).reshape(1, 1, tq, tk)
    if key_mask is not None:
        visible = visible & (key_mask != 0).reshape(b, 1, 1, tk)
    if doc_ids is not None:
        if tuple(doc_ids.shape) != (1, tk):
            raise ValueError(f"doc_ids must be [1, Tk] = {(1, tk)}; got {tuple(doc_ids.shape)}")
        q_docs = doc_ids[:, q_offset : q_offset + tq].reshape(1, 1, tq, 1)
        visible = visible & (q_docs == doc_ids.reshape(1, 1, 1, tk))
    o_BHTD = xp.masked_attention(q_BHTD, k_BHTD, v_BHTD, visible)
    return xp.swapaxes(o_BHTD, 1, 2).reshape(b, tq, h * d)


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
