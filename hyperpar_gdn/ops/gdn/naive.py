"""Readable token-by-token reference of the gated delta rule (the definition, not a fast path)."""

from __future__ import annotations

from typing import Any

from hyperpar_gdn.ops.gdn.common import check_document_states, check_inputs, prepare_qkv
from hyperpar_gdn.ops.gdn.varlen import check_cu_seqlens
from hyperpar_gdn.platform import Tensor


def recurrent_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Any = None,
) -> tuple[Tensor, Tensor | None]:
    """Per token: S = exp(g_t) (I - beta_t k_t k_t^T) S + beta_t k_t v_t^T;  o_t = S^T q_t.
    At the first token of a packed document S is first replaced by that document's initial state.

    Args:
        q, k: ``[B, T, Hk, K]``; v: ``[B, T, H, V]`` with H a multiple of Hk.
        g: ``[B, T, H]`` log decay (<= 0); beta: ``[B, T, H]``.
        initial_state: ``[B, H, K, V]`` or None (zeros).
        cu_seqlens: packed documents, int ``[N+1]`` (fla's contract): B must be 1; initial_state
            and the final state are then per document, ``[N, H, K, V]``.

    Returns:
        o ``[B, T, H, V]`` in q's dtype; the final state ``[B, H, K, V]`` (``[N, H, K, V]`` with
        cu_seqlens; fp32, or fp64 for fp64 input) if ``output_final_state``.

    Example:
        >>> import torch
        >>> q, k, v = (torch.randn(1, 5, 2, 8) for _ in range(3))
        >>> g, beta = -torch.rand(1, 5, 2), torch.rand(1, 5, 2)
        >>> o, s = recurrent_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
        >>> tuple(o.shape), tuple(s.shape)
        ((1, 5, 2, 8), (1, 2, 8, 8))
    """
    if cu_seqlens is None:
        check_inputs(q, k, v, g, beta, initial_state)
        starts: list[int] = [0]
    else:
        check_inputs(q, k, v, g, beta, None)
        starts = check_cu_seqlens(cu_seqlens, seq_len=q.shape[1], batch_size=q.shape[0])[:-1].tolist()
        check_document_states(initial_state, len(starts), v.shape[2], q.shape[3], v.shape[3])
    out_dtype = q.dtype
    xp, (q, k, v, g, beta) = prepare_qkv(q, k, v, g, beta, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    if initial_state is None:
        initial_state = xp.zeros((len(starts) * b, h, dk, dv), like=v)
    doc_of_start = {start: n for n, start in enumerate(starts)}
    s, finals = None, []
    decay = xp.exp(g).reshape(b, t, h, 1, 1)
    outputs = []
    for i in range(t):
        if i in doc_of_start:  # a document starts: keep the previous one's state, load its own
            if s is not None:
                finals.append(s)
            n = doc_of_start[i]
            s = xp.cast(initial_state[n * b : (n + 1) * b], v.dtype)
        q_t, k_t, v_t = q[:, i].reshape(b, h, 1, dk), k[:, i].reshape(b, h, 1, dk), v[:, i]
        s = decay[:, i] * s
        predicted = xp.matmul(k_t, s).reshape(b, h, dv)
        delta = (v_t - predicted) * beta[:, i].reshape(b, h, 1)
        s = s + xp.matmul(xp.swapaxes(k_t, -1, -2), delta.reshape(b, h, 1, dv))
        outputs.append(xp.matmul(q_t, s).reshape(b, h, dv))
    o = xp.cast(xp.stack(outputs, 1), out_dtype)
    finals.append(s)
    return o, (xp.cat(finals, 0) if output_final_state else None)
