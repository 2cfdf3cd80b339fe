"""Blockwise causal softmax attention, written once against the platform's tensor functions.

Queries are walked in blocks; each block meets only the key blocks its queries may see
(:class:`~hyperpar_gdn.ops.attention.visibility.BlockMap`), with an online softmax: a running row
maximum m, a running sum l and an output accumulator, rescaled by ``exp(m_old - m_new)`` when a
block raises the maximum. Fully visible blocks run without a mask; from the others a block-sized
bias is subtracted (0 where visible, +inf where hidden). Extra memory: one ``[B, H, bq, bk]``
score block, never ``[Tq, Tk]``. The row statistics (m, lse, rowsum(do o)) reach their blocks through
``xp.sub`` / ``xp.mul`` and the probabilities through ``xp.softmax_exp``, which a framework may
serve faster than plain broadcasting and ``exp`` (MindSpore on CPU: docs/backends.md).

The backward walks the same blocks from the saved output o and log-sum-exp ``lse = m + log l``:
``p = exp(s - lse)``, ``dp = do v^T``, ``ds = p (dp - rowsum(do o))``, then dq, dk, dv per block.

Grouped KV heads are not repeated: the G query heads of one KV head are interleaved along the
rows, ``q [B, Hkv, Tq*G, D]`` with row ``t*G + j`` for query t of the group's j-th head, against
``k [B, Hkv, bk, D]``. A query block is then a run of consecutive rows ``[B, Hkv, bq*G, D]``, a
view of the rows rather than a gather of G strided pieces (MindSpore on CPU copies such a piece
at a few hundred MB/s); q goes into this order and o out of it once per call.

Legend: B batch, H query heads, Hkv key/value heads, G = H / Hkv, D head dim, bq / bk block sizes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hyperpar_gdn.ops.attention.visibility import FULL, NONE, BlockMap
from hyperpar_gdn.platform import Tensor, TensorOps

# A finite start for the running maximum: exp(-inf - m) is then 0 for hidden scores, never NaN.
_FLOOR = -1e30


def blockwise_attention(
    xp: TensorOps, q_BHTD: Tensor, k_BHTD: Tensor, v_BHTD: Tensor, block_map: BlockMap
) -> Tensor:
    """Attention of q ``[B, H, Tq, D]`` over k, v ``[B, Hkv, Tk, D]`` by ``block_map`` (scale
    ``D**-0.5``) -> ``[B, H, Tq, D]`` in q's dtype; a query that sees no key gives zeros."""
    b, h, tq, d = q_BHTD.shape
    hkv = k_BHTD.shape[1]
    g = h // hkv
    dtype = xp.compute_dtype(q_BHTD)
    q, k, v = (xp.cast(x, dtype) for x in (q_BHTD, k_BHTD, v_BHTD))
    q_rows = _swap_heads_and_tokens(xp, q.reshape(b, hkv, g, tq, d)).reshape(b, hkv, tq * g, d)
    fwd, bwd = _functions(xp, block_map, g, d**-0.5)
    (o_rows,) = xp.custom_vjp(fwd, bwd, q_rows, k, v)
    o = _swap_heads_and_tokens(xp, o_rows.reshape(b, hkv, tq, g, d))
    return xp.cast(o.reshape(b, h, tq, d), xp.dtype(q_BHTD))


def _swap_heads_and_tokens(xp: TensorOps, x: Tensor) -> Tensor:
    """``[B, Hkv, A, C, D] -> [B, Hkv, C, A, D]`` (nothing to move when A or C is 1)."""
    b, hkv, a, c, d = x.shape
    return x.reshape(b, hkv, c, a, d) if 1 in (a, c) else xp.permute(x, (0, 1, 3, 2, 4))


# Long on purpose: the forward, the backward and the block-mask cache they share are closures over
# one block map; split apart they would pass the map, the sizes and the cache between them.
def _functions(xp: TensorOps, block_map: BlockMap, groups: int, scale: float) -> tuple[Any, Any]:
    """The forward and backward of one call (they share the block map and its masks)."""
    q_sizes, k_sizes = block_map.q_sizes(), block_map.k_sizes()
    row_sizes = [size * groups for size in q_sizes]
    biases: dict[tuple[int, int], Tensor] = {}

    def hidden(i: int, j: int, like: Tensor) -> Tensor:
        """``[B or 1, 1, bq, 1, bk]``: 0 where visible, +inf elsewhere (subtracted from scores)."""
        if (i, j) not in biases:
            mask = block_map.mask(i, j)
            values = np.where(mask, 0.0, np.inf)[:, None, :, None, :]
            biases[(i, j)] = xp.constant(values, like=like)
        return biases[(i, j)]

    def scores(q_i: Tensor, kt_j: Tensor, i: int, j: int) -> Tensor:
        """``[B, Hkv, bq*G, bk]``: scaled scores, -inf where hidden."""
        s = xp.matmul(q_i, kt_j) * xp.scalar(scale, q_i)
        if block_map.kind[i, j] == FULL:
            return s
        b, hkv, rows, bk = s.shape
        return xp.sub(s.reshape(b, hkv, rows // groups, groups, bk), hidden(i, j, s)).reshape(
            b, hkv, rows, bk
        )

    def rows(x: Tensor) -> list[Tensor]:
        """``[B, Hkv, Tq*G, X]`` -> per query block ``[B, Hkv, bq*G, X]`` (views)."""
        return xp.split(x, row_sizes, 2)

    def forward(q: Tensor, k: Tensor, v: Tensor) -> tuple[tuple[Tensor], tuple[Tensor, ...]]:
        b, hkv, _, d = q.shape
        k_blocks, v_blocks = xp.split(k, k_sizes, 2), xp.split(v, k_sizes, 2)
        kt_blocks = [xp.swapaxes(kb, -1, -2) for kb in k_blocks]
        outs, lses = [], []
        for i, q_i in enumerate(rows(q)):
            m = xp.zeros((b, hkv, q_i.shape[2], 1), like=q) + xp.scalar(_FLOOR, q)
            row_sum = acc = None
            for j in np.flatnonzero(block_map.kind[i] != NONE):
                s = scores(q_i, kt_blocks[j], i, int(j))
                m_new = xp.maximum(m, xp.amax(s, -1, keepdim=True))
                p = xp.softmax_exp(xp.sub(s, m_new))
                if acc is None:
                    row_sum, acc = xp.sum(p, -1, keepdim=True), xp.matmul(p, v_blocks[j])
                else:
                    alpha = xp.exp(m - m_new)
                    row_sum = row_sum * alpha + xp.sum(p, -1, keepdim=True)
                    acc = xp.mul(acc, alpha) + xp.matmul(p, v_blocks[j])
                m = m_new
            if acc is None:  # no key block visible to this query block
                outs.append(xp.zeros((b, hkv, q_i.shape[2], d), like=q))
                lses.append(m)
                continue
            safe = row_sum + xp.cast(
                row_sum == 0, xp.dtype(row_sum)
            )  # rows that saw no key: o = 0, lse = floor
            outs.append(acc / safe)
            lses.append(m + xp.log(safe))
        o, lse = _cat_rows(xp, outs), _cat_rows(xp, lses)
        return (o,), (q, k, v, o, lse)

    def backward(saved: tuple[Tensor, ...], do: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v, o, lse = saved
        do = xp.cast(do, xp.dtype(o))
        k_blocks, v_blocks = xp.split(k, k_sizes, 2), xp.split(v, k_sizes, 2)
        kt_blocks = [xp.swapaxes(kb, -1, -2) for kb in k_blocks]
        vt_blocks = [xp.swapaxes(vb, -1, -2) for vb in v_blocks]
        delta = xp.sum(do * o, -1, keepdim=True)  # [B, Hkv, Tq*G, 1]
        dk: list[Tensor | None] = [None] * len(k_sizes)
        dv: list[Tensor | None] = [None] * len(k_sizes)
        dqs = []
        blocks = zip(rows(q), rows(do), rows(lse), rows(delta), strict=True)
        for i, (q_i, do_i, lse_i, delta_i) in enumerate(blocks):
            dq_i = None
            for j in np.flatnonzero(block_map.kind[i] != NONE):
                p = xp.softmax_exp(xp.sub(scores(q_i, kt_blocks[j], i, int(j)), lse_i))
                ds = p * xp.sub(xp.matmul(do_i, vt_blocks[j]), delta_i)
                pt, dst = xp.swapaxes(p, -1, -2), xp.swapaxes(ds, -1, -2)
                dv_j, dk_j, dq_ij = xp.matmul(pt, do_i), xp.matmul(dst, q_i), xp.matmul(ds, k_blocks[j])
                dv[j] = dv_j if dv[j] is None else dv[j] + dv_j
                dk[j] = dk_j if dk[j] is None else dk[j] + dk_j
                dq_i = dq_ij if dq_i is None else dq_i + dq_ij
            dqs.append(xp.zeros(q_i.shape, like=q) if dq_i is None else dq_i)
        scale_t = xp.scalar(scale, q)
        dq = _cat_rows(xp, dqs) * scale_t
        dk_full = xp.cat([_or_zeros(xp, g, kb) for g, kb in zip(dk, k_blocks, strict=True)], 2) * scale_t
        dv_full = xp.cat([_or_zeros(xp, g, vb) for g, vb in zip(dv, v_blocks, strict=True)], 2)
        return dq, dk_full, dv_full

    return forward, backward


def _cat_rows(xp: TensorOps, blocks: list[Tensor]) -> Tensor:
    """Per query block ``[B, Hkv, bq*G, X]`` -> ``[B, Hkv, Tq*G, X]``."""
    return xp.cat(blocks, 2) if len(blocks) > 1 else blocks[0]


def _or_zeros(xp: TensorOps, grad: Tensor | None, like: Tensor) -> Tensor:
    return xp.zeros(like.shape, like=like) if grad is None else grad
