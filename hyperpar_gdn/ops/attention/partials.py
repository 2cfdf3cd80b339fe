"""Softmax attention of one new token over a part of the keys, and the merge of such parts by
their log-sum-exp (decoding with the key/value cache split over ranks).

A query's attention over keys split into parts s (each part's keys all visible to it):
``o_s = softmax(q K_s^T * scale) V_s`` and ``lse_s = log sum exp(q K_s^T * scale)``; over all keys
``lse = log sum_s exp(lse_s)`` and ``o = sum_s exp(lse_s - lse) o_s``. A part with no keys has
``lse_s = -inf`` and contributes nothing. :func:`merged_reference` beside the merge computes the
same by concatenating the parts (the test compares the two).

Legend: B batch, H query heads, Hkv key/value heads, Tq queries, Tk keys, D head dim, R parts.
"""

from __future__ import annotations

from collections.abc import Sequence

from hyperpar_gdn.platform import Tensor, TensorOps

__all__ = ["merge_partials", "merged_reference", "partial_attention"]


def partial_attention(
    xp: TensorOps, q_BHQD: Tensor, k_BHTD: Tensor, v_BHTD: Tensor, *, scale: float
) -> tuple[Tensor, Tensor]:
    """Queries ``[B, H, Tq, D]`` over keys and values ``[B, Hkv, Tk, D]`` (all visible; H a
    multiple of Hkv, query head i reads key head i // (H/Hkv)) -> (o ``[B, H, Tq, D]``,
    lse ``[B, H, Tq, 1]``), both in the compute dtype (fp32, fp64 for fp64 inputs). Tk = 0 gives
    o = 0 and lse = -inf."""
    h, hkv = q_BHQD.shape[1], k_BHTD.shape[1]
    dtype = xp.compute_dtype(q_BHQD)
    q = xp.cast(q_BHQD, dtype)
    k = xp.cast(xp.repeat_interleave(k_BHTD, h // hkv, 1), dtype)
    v = xp.cast(xp.repeat_interleave(v_BHTD, h // hkv, 1), dtype)
    if k.shape[2] == 0:
        b, _, tq, d = q.shape
        o = xp.zeros((b, h, tq, v.shape[-1]), like=q)
        return o, xp.log(xp.zeros((b, h, tq, 1), like=q))
    scores = xp.matmul(q, xp.swapaxes(k, 2, 3)) * xp.scalar(scale, like=q)  # [B, H, Tq, Tk]
    m = xp.amax(scores, -1, keepdim=True)
    p = xp.exp(scores - m)
    total = xp.sum(p, -1, keepdim=True)
    return xp.matmul(p, v) / total, m + xp.log(total)


def merge_partials(xp: TensorOps, o_RBHQD: Tensor, lse_RBHQ1: Tensor) -> Tensor:
    """The parts' outputs ``[R, B, H, Tq, D]`` and log-sum-exps ``[R, B, H, Tq, 1]`` -> the
    attention over all their keys ``[B, H, Tq, D]`` (compute dtype)."""
    top = xp.amax(lse_RBHQ1, 0, keepdim=True)  # finite: every query sees at least one key somewhere
    weights = xp.exp(lse_RBHQ1 - top)  # [R, B, H, Tq, 1]
    return xp.sum(weights * o_RBHQD, 0) / xp.sum(weights, 0)


def merged_reference(
    xp: TensorOps, q_BHQD: Tensor, ks: Sequence[Tensor], vs: Sequence[Tensor], *, scale: float
) -> Tensor:
    """:func:`merge_partials` by concatenation: one :func:`partial_attention` over all parts' keys."""
    return partial_attention(xp, q_BHQD, xp.cat(list(ks), 2), xp.cat(list(vs), 2), scale=scale)[0]
