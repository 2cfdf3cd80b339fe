"""Chunked gated delta rule: batched chunk preparation, then the state recurrence.

Legend: B batch, T tokens, H value heads, K key dim, V value dim, N chunks, C chunk size.
Within a chunk, G = cumsum(g) and D_ij = exp(G_i - G_j) for j <= i (0 above the diagonal).
The intra-chunk delta-rule corrections solve (I + tril(diag(beta) k k^T * D, -1)) X = rhs once,
for rhs = [beta v | beta exp(G) k], giving u and w (see DESIGN.md section 2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hyperpar_gdn.platform import Tensor, TensorOps

from .common import check_inputs, prepare_qkv
from .recurrence import chunk_outputs


@dataclass
class ChunkPrep:
    """Everything about a sequence that does not depend on the entering state.

    Computed once and shared by the state summary and the output pass (context parallel runs
    both on the same prep). Tensors are chunk-major ``[N, B, H, C, *]`` (chunk i is the
    contiguous block ``x[i]``) in the compute dtype.
    """

    xp: TensorOps
    qg: Tensor  # [N, B, H, C, K]  q * exp(G)
    p: Tensor  # [N, B, H, C, C]  tril(q k^T * D)
    u: Tensor  # [N, B, H, C, V]
    w: Tensor  # [N, B, H, C, K]
    kd: Tensor  # [N, B, H, C, K]  k * exp(G_last - G)
    gl: Tensor  # [N, B, H]        exp(G_last)
    seq_len: int  # T before padding
    out_dtype: Any

    @property
    def state_shape(self) -> tuple[int, int, int, int]:
        _, b, h, _, dk = self.w.shape
        return (b, h, dk, self.u.shape[-1])


def prepare_chunks(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    chunk_size: int = 64,
    use_qk_l2norm_in_kernel: bool = False,
    initial_state: Tensor | None = None,
) -> ChunkPrep:
    """Check the inputs, pad T to a multiple of ``chunk_size`` and compute the chunk quantities.

    q, k ``[B, T, Hk, K]``; v ``[B, T, H, V]``; g, beta ``[B, T, H]``. Padded tokens have
    beta = 0 and g = 0, so they leave the state unchanged.
    """
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int; got {chunk_size!r}")
    check_inputs(q, k, v, g, beta, initial_state)
    out_dtype = q.dtype
    xp, (q, k, v, g, beta) = prepare_qkv(q, k, v, g, beta, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    c = chunk_size
    n = -(-t // c)
    pad = n * c - t

    def chunked(x: Tensor) -> Tensor:  # [B, T, H, D] -> [N, B, H, C, D]
        x = xp.pad_dim(x, 1, 0, pad).reshape(b, n, c, h, x.shape[-1])
        return xp.permute(x, (1, 0, 3, 2, 4))

    q, k, v = chunked(q), chunked(k), chunked(v)
    g, beta = chunked(g.reshape(b, t, h, 1)), chunked(beta.reshape(b, t, h, 1))  # [N, B, H, C, 1]

    big_g = xp.cumsum(g, 3)  # [N, B, H, C, 1]
    decay = xp.tril(xp.exp(xp.tril(big_g - xp.swapaxes(big_g, -1, -2))))  # [N, B, H, C, C]
    exp_g = xp.exp(big_g)
    k_beta = k * beta
    k_t = xp.swapaxes(k, -1, -2)
    a = xp.tril(xp.matmul(k_beta, k_t) * decay, -1)
    solved = xp.solve_unit_lower(a, xp.cat([v * beta, k_beta * exp_g], -1))
    g_last = big_g[:, :, :, c - 1 :]  # [N, B, H, 1, 1]
    return ChunkPrep(
        xp=xp,
        qg=q * exp_g,
        p=xp.matmul(q, k_t) * decay,
        u=solved[..., :dv],
        w=solved[..., dv:],
        kd=k * xp.exp(g_last - big_g),
        gl=xp.exp(g_last).reshape(n, b, h),
        seq_len=t,
        out_dtype=out_dtype,
    )


def outputs_from(prep: ChunkPrep, initial_state: Tensor | None) -> tuple[Tensor, Tensor]:
    """Run the chunks from ``initial_state`` ``[B, H, K, V]`` (zeros if None).

    Returns o ``[B, T, H, V]`` in the input dtype and the final state (compute dtype)."""
    xp = prep.xp
    s0 = (
        xp.zeros(prep.state_shape, like=prep.u)
        if initial_state is None
        else xp.cast(initial_state, prep.u.dtype)
    )
    o, s_final = chunk_outputs(xp, prep.qg, prep.p, prep.u, prep.w, prep.kd, prep.gl, s0)
    n, b, h, c, dv = o.shape
    o = xp.permute(o, (1, 0, 3, 2, 4)).reshape(b, n * c, h, dv)[:, : prep.seq_len]
    return xp.cast(o, prep.out_dtype), s_final


def chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    chunk_size: int = 64,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """The gated delta rule in chunks of ``chunk_size`` tokens (same results as
    :func:`hyperpar_gdn.ops.recurrent_gated_delta_rule`).

    Args:
        q, k: ``[B, T, Hk, K]``; v: ``[B, T, H, V]`` (H a multiple of Hk; q/k heads are
            repeated, interleaved). Any T: it is padded inside.
        g: ``[B, T, H]`` log decay (<= 0); beta: ``[B, T, H]``.
        initial_state: ``[B, H, K, V]`` or None; differentiable.

    Returns:
        o ``[B, T, H, V]`` in q's dtype (accumulated in fp32, or fp64 for fp64 inputs) and, if
        ``output_final_state``, the final state ``[B, H, K, V]`` in the compute dtype.

    Example:
        >>> import torch
        >>> q, k, v = (torch.randn(2, 100, 4, 16) for _ in range(3))
        >>> g, beta = -torch.rand(2, 100, 4), torch.rand(2, 100, 4)
        >>> o, s = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
        >>> tuple(o.shape), tuple(s.shape)
        ((2, 100, 4, 16), (2, 4, 16, 16))
    """
    prep = prepare_chunks(
        q,
        k,
        v,
        g,
        beta,
        chunk_size=chunk_size,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        initial_state=initial_state,
    )
    o, s_final = outputs_from(prep, initial_state)
    return o, (s_final if output_final_state else None)
