"""Causal softmax attention through a platform's fused kernel, with no mask anywhere.

The visible (query, key) pairs are cut into rectangles that are fully visible or causal squares
(:class:`~hyperpar_gdn.ops.attention.visibility.Segments`); the kernel runs each one and returns its
output and log-sum-exp; the rectangles of one query run are merged exactly:
``lse = log(sum_s exp(lse_s))``, ``o = sum_s exp(lse_s - lse) o_s``. Hidden key blocks are never
computed, and a single causal sequence is one ``is_causal`` call.

The backward calls the kernel's backward once per rectangle with the merged o and lse of its
rows (the gradient of a softmax over the union, split by rectangle), and adds the pieces up per
query run and per key run.

Legend: B batch, H query heads, Hkv key/value heads, Tq queries, Tk keys, D head dim.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hyperpar_gdn.ops.attention.visibility import Segments
from hyperpar_gdn.platform import AttentionKernel, Tensor, TensorOps

_FLOOR = -1e30  # a finite floor for the running maximum (no exp(-inf + inf))


def segment_attention(
    xp: TensorOps, kernel: AttentionKernel, q_BHTD: Tensor, k_BHTD: Tensor, v_BHTD: Tensor, segments: Segments
) -> Tensor:
    """Attention of q ``[B, H, Tq, D]`` over k, v ``[B, Hkv, Tk, D]`` by ``segments`` (scale
    ``D**-0.5``) -> ``[B, H, Tq, D]``; a query of no rectangle gives zeros."""
    fwd, bwd = _functions(xp, kernel, segments, q_BHTD.shape[-1] ** -0.5)
    (o,) = xp.custom_vjp(fwd, bwd, q_BHTD, k_BHTD, v_BHTD)
    return o


def _functions(xp: TensorOps, kernel: AttentionKernel, segments: Segments, scale: float) -> tuple[Any, Any]:
    def in_run(run: tuple[int, int], lo: int, hi: int) -> bool:
        return run[0] <= lo and hi <= run[1]

    # The query runs tile the queries in order; each rectangle lies in one query and one key run.
    by_q_run = {
        run: [seg for seg in segments.segments if in_run(run, seg.q0, seg.q1)] for run in segments.q_runs
    }
    k_run_of = {
        seg: next(r for r in segments.k_runs if in_run(r, seg.k0, seg.k1)) for seg in segments.segments
    }

    def forward(q: Tensor, k: Tensor, v: Tensor) -> tuple[tuple[Tensor], tuple[Tensor, ...]]:
        b, h, tq, d = q.shape
        pieces, lse_pieces = [], []
        for run in segments.q_runs:
            n = run[1] - run[0]
            o_run = lse_run = None
            for seg in by_q_run[run]:
                o_s, lse_s = kernel.forward(
                    q[:, :, seg.q0 : seg.q1],
                    k[:, :, seg.k0 : seg.k1],
                    v[:, :, seg.k0 : seg.k1],
                    causal=seg.causal,
                    scale=scale,
                )
                before, after = seg.q0 - run[0], run[1] - seg.q1
                o_s = xp.pad_dim(xp.cast(o_s, xp.dtype(lse_s)), 2, before, after)
                lse_s = xp.pad_dim(lse_s, 2, before, after)
                if before or after:  # rows outside the rectangle: lse = -inf
                    outside = np.full(n, -np.inf)
                    outside[before : n - after] = 0.0
                    lse_s = lse_s + xp.constant(outside, like=lse_s)
                o_run, lse_run = (o_s, lse_s) if o_run is None else _merge(xp, o_run, lse_run, o_s, lse_s)
            if o_run is None:  # these queries see no key
                o_run = xp.zeros((b, h, n, d), like=q)
                lse_run = _empty_lse(xp, (b, h, n), like=q)
            pieces.append(xp.cast(o_run, xp.dtype(q)))
            lse_pieces.append(lse_run)
        o = xp.cat(pieces, 2) if len(pieces) > 1 else pieces[0]
        lse = xp.cat(lse_pieces, 2) if len(lse_pieces) > 1 else lse_pieces[0]
        return (o,), (q, k, v, o, lse)

    def backward(saved: tuple[Tensor, ...], do: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v, o, lse = saved
        do = xp.cast(do, xp.dtype(o))
        dq_parts = []
        dk_runs: dict[tuple[int, int], Tensor] = {}
        dv_runs: dict[tuple[int, int], Tensor] = {}
        for run in segments.q_runs:
            dq_run = None
            for seg in by_q_run[run]:
                rows, cols = slice(seg.q0, seg.q1), slice(seg.k0, seg.k1)
                dq_s, dk_s, dv_s = kernel.backward(
                    do[:, :, rows],
                    q[:, :, rows],
                    k[:, :, cols],
                    v[:, :, cols],
                    o[:, :, rows],
                    lse[:, :, rows],
                    causal=seg.causal,
                    scale=scale,
                )
                dq_s = xp.pad_dim(dq_s, 2, seg.q0 - run[0], run[1] - seg.q1)
                dq_run = dq_s if dq_run is None else dq_run + dq_s
                k_run = k_run_of[seg]
                pad = (seg.k0 - k_run[0], k_run[1] - seg.k1)
                dk_s, dv_s = xp.pad_dim(dk_s, 2, *pad), xp.pad_dim(dv_s, 2, *pad)
                dk_runs[k_run] = dk_s if k_run not in dk_runs else dk_runs[k_run] + dk_s
                dv_runs[k_run] = dv_s if k_run not in dv_runs else dv_runs[k_run] + dv_s
            dq_parts.append(xp.zeros(q[:, :, run[0] : run[1]].shape, like=q) if dq_run is None else dq_run)
        return (
            xp.cat(dq_parts, 2) if len(dq_parts) > 1 else dq_parts[0],
            _by_runs(xp, dk_runs, k),
            _by_runs(xp, dv_runs, v),
        )

    return forward, backward


def _merge(xp: TensorOps, o_a: Tensor, lse_a: Tensor, o_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Two softmax results over disjoint keys as one: o ``[B, H, n, D]``, lse ``[B, H, n]``."""
    m = xp.maximum(xp.maximum(lse_a, lse_b), xp.scalar(_FLOOR, lse_a))
    w_a, w_b = xp.exp(lse_a - m), xp.exp(lse_b - m)
    total = w_a + w_b
    safe = total + xp.cast(total == 0, xp.dtype(total))
    shape = (*total.shape, 1)
    o = o_a * (w_a / safe).reshape(shape) + o_b * (w_b / safe).reshape(shape)
    return o, m + xp.log(total)


def _empty_lse(xp: TensorOps, shape: tuple[int, ...], like: Tensor) -> Tensor:
    """-inf: rows that see no key."""
    return xp.log(xp.zeros(shape, like=xp.cast(like, xp.compute_dtype(like))))


def _by_runs(xp: TensorOps, grads: dict[tuple[int, int], Tensor], like: Tensor) -> Tensor:
    """Per key run gradients -> ``[B, Hkv, Tk, D]`` like ``like`` (zeros between runs)."""
    parts, start = [], 0
    for run in sorted(grads):
        if start < run[0]:
            parts.append(xp.zeros(like[:, :, start : run[0]].shape, like=like))
        parts.append(xp.cast(grads[run], xp.dtype(like)))
        start = run[1]
    if start < like.shape[2]:
        parts.append(xp.zeros(like[:, :, start:].shape, like=like))
    return xp.cat(parts, 2) if len(parts) > 1 else parts[0]
