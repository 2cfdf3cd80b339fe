"""The chunk preparation of the gated delta rule as one hand-written forward/backward pair:
head repeat, chunking, l2norm, gates (restarted at document cuts), the decay mask and the
triangular inverse, every intermediate saved (:class:`PrepSaved`) and the chunk-major layout
``[N, B, H, C, D]`` made once. :mod:`.chunk` wraps them into :class:`~.chunk.ChunkPrep`.

Legend: B batch, T tokens, H value heads, K key dim, V value dim, N chunks, C chunk size.
"""

from __future__ import annotations

from typing import NamedTuple

from hyperpar_gdn.ops.gdn.common import L2NORM_EPS, from_chunks, to_chunks
from hyperpar_gdn.ops.gdn.varlen import ChunkMasks
from hyperpar_gdn.platform import Tensor, TensorOps


def _t(xp: TensorOps, x: Tensor) -> Tensor:
    return xp.swapaxes(x, -1, -2)


def _rev_cumsum(xp: TensorOps, x: Tensor, dim: int) -> Tensor:
    """y_i = sum_{j >= i} x_j along ``dim``."""
    return xp.sum(x, dim, keepdim=True) - xp.cumsum(x, dim) + x


# --- the preparation: forward and backward ---------------------------------------------------------


class PrepSaved(NamedTuple):
    """What :func:`prep_backward` needs from :func:`prep_forward` (chunk-major, compute dtype)."""

    q: Tensor  # [N, B, H, C, K]  l2-normalised (if asked) and scaled by K^-0.5
    k: Tensor  # [N, B, H, C, K]  l2-normalised (if asked)
    v: Tensor  # [N, B, H, C, V]
    beta: Tensor  # [N, B, H, C, 1]
    exp_g: Tensor  # [N, B, H, C, 1]  exp(G)
    exp_rest: Tensor  # [N, B, H, C, 1]  exp(G_last - G)
    gl: Tensor  # [N, B, H, 1, 1]  exp(G_last)
    decay: Tensor  # [N, B, H, C, C]  D (lower triangle, diagonal included)
    decay_strict: Tensor  # [N, B, H, C, C]  tril(D, -1)
    kkd: Tensor  # [N, B, H, C, C]  k k^T * tril(D, -1); A = diag(beta) kkd
    tinv: Tensor  # [N, B, H, C, C]  (I + A)^-1
    tinv_b: Tensor  # [N, B, H, C, C]  Tinv diag(beta)
    tinv_bg: Tensor  # [N, B, H, C, C]  Tinv diag(beta exp(G))
    p: Tensor  # [N, B, H, C, C]  q k^T * D
    rq: Tensor | None  # [N, B, H, C, 1]  rsqrt(|q|^2 + eps) of the raw q (None without l2norm)
    rk: Tensor | None  # [N, B, H, C, 1]


def prep_forward(
    xp: TensorOps,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    chunk_size: int,
    use_qk_l2norm: bool,
    masks: ChunkMasks | None = None,
) -> tuple[tuple[Tensor, ...], PrepSaved]:
    """Chunk quantities of q, k ``[B, T, Hk, K]``, v ``[B, T, H, V]``, g, beta ``[B, T, H]`` (compute
    dtype; T is padded to a multiple of ``chunk_size`` with beta = g = 0, which leave the state
    unchanged). ``masks``: where documents start inside chunks (None: nowhere).

    Returns the outputs (qg, p, u, w, kd ``[N, B, H, C, *]``, gl ``[N, B, H]``, as in
    :class:`ChunkPrep`) and what :func:`prep_backward` needs.
    """
    b, t, hk, dk = q.shape
    h = v.shape[2]
    c = chunk_size
    groups = h // hk
    q = to_chunks(xp, xp.repeat_interleave(q, groups, 2), c)  # [N, B, H, C, K]
    k = to_chunks(xp, xp.repeat_interleave(k, groups, 2), c)
    v = to_chunks(xp, v, c)  # [N, B, H, C, V]
    g = to_chunks(xp, g.reshape(b, t, h, 1), c)  # [N, B, H, C, 1]
    beta = to_chunks(xp, beta.reshape(b, t, h, 1), c)
    n = q.shape[0]

    scale = xp.scalar(dk**-0.5, q)
    rq = rk = None
    if use_qk_l2norm:
        eps = xp.scalar(L2NORM_EPS, q)
        rq = xp.rsqrt(xp.sum(q * q, -1, keepdim=True) + eps)  # [N, B, H, C, 1]
        rk = xp.rsqrt(xp.sum(k * k, -1, keepdim=True) + eps)
        q = xp.mul(q, rq * scale)
        k = xp.mul(k, rk)
    else:
        q = q * scale

    if masks is None:
        big_g = xp.cumsum(g, 3)  # G  [N, B, H, C, 1]
        g_last = big_g[:, :, :, c - 1 :]  # [N, B, H, 1, 1]
        exp_g = xp.exp(big_g)
        exp_rest = xp.exp(g_last - big_g)
        gl = xp.exp(g_last)
        # tril inside the exp keeps exp(G_i - G_j) >= 1 above the diagonal from overflowing.
        decay = xp.tril(xp.exp(xp.tril(big_g - _t(xp, big_g))))  # [N, B, H, C, C]
    else:
        # Gates restart at every cut (G sums g over the token's own document only); the entering
        # state reaches the first document of the chunk only, the leaving state is built from the
        # last one only. Masks multiply the exponents too, so no masked entry can overflow.
        seg, first, last = masks.seg_tril, masks.first, masks.last
        big_g = xp.matmul(seg, g)
        g_last = big_g[:, :, :, c - 1 :]
        exp_g = xp.exp(big_g) * first
        exp_rest = xp.exp((g_last - big_g) * last) * last
        gl = xp.exp(g_last) * first[:, :, :, c - 1 :]
        decay = xp.exp((big_g - _t(xp, big_g)) * seg) * seg
    decay_strict = xp.tril(decay, -1)

    k_t = _t(xp, k)
    kkd = xp.matmul(k, k_t) * decay_strict
    p = xp.matmul(q, k_t) * decay
    eye = xp.zeros((n, b, h, c, c), like=q) + xp.eye(c, like=q)
    tinv = xp.solve_unit_lower(xp.mul(kkd, beta), eye)  # (I + A)^-1, unit lower triangular
    # Scaling Tinv's columns ([C, C]) is cheaper than scaling v and k ([C, D]).
    tinv_b = xp.mul(tinv, _t(xp, beta))
    tinv_bg = xp.mul(tinv, _t(xp, beta * exp_g))
    u = xp.matmul(tinv_b, v)
    w = xp.matmul(tinv_bg, k)
    outputs = (xp.mul(q, exp_g), p, u, w, xp.mul(k, exp_rest), gl.reshape(n, b, h))
    saved = PrepSaved(
        q, k, v, beta, exp_g, exp_rest, gl, decay, decay_strict, kkd, tinv, tinv_b, tinv_bg, p, rq, rk
    )
    return outputs, saved


# One function for the whole backward of the preparation, kept long on purpose: it walks the
# forward's stages in reverse with the saved intermediates side by side, which split helpers
# would have to pass around as a dozen arguments.
def prep_backward(
    xp: TensorOps,
    saved: PrepSaved,
    dqg: Tensor,
    dp: Tensor,
    du: Tensor,
    dw: Tensor,
    dkd: Tensor,
    dgl: Tensor,
    *,
    seq_len: int,
    num_k_heads: int,
    masks: ChunkMasks | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of :func:`prep_forward`'s inputs from those of its outputs (qg, p, u, w, kd
    ``[N, B, H, C, *]``, gl ``[N, B, H]``).

    Returns dq, dk ``[B, T, Hk, K]``, dv ``[B, T, H, V]``, dg, dbeta ``[B, T, H]``.

    Passes over ``[N, B, H, C, D]`` tensors cost the most here, so row dot products are taken from
    ``[C, C]`` products where they are at hand, e.g. <(dqk k)_i, q_i> = rowsum(dqk * q k^T)_i, and
    the per-column scalings of u and w are gradients of ``[C, C]`` matrices.
    """
    x = saved
    n, b, h, c, kdim = x.q.shape

    def rowsum(y: Tensor) -> Tensor:  # [.., C, C] -> [.., C, 1]
        return xp.sum(y, -1, keepdim=True)

    def colsum(y: Tensor) -> Tensor:  # [.., C, C] -> [.., C, 1]
        return _t(xp, xp.sum(y, -2, keepdim=True))

    # u = Tb v, w = Tbg k with Tb = Tinv diag(beta), Tbg = Tinv diag(beta exp(G)).
    dv = xp.matmul(_t(xp, x.tinv_b), du)
    d_tb = xp.matmul(du, _t(xp, x.v))  # [N, B, H, C, C]
    d_tbg = xp.matmul(dw, _t(xp, x.k))
    dbeta_tb = colsum(d_tb * x.tinv)  # [N, B, H, C, 1]
    dbg_tbg = colsum(d_tbg * x.tinv)  # gradient of beta exp(G) through Tbg
    d_tinv = xp.mul(d_tb, _t(xp, x.beta)) + xp.mul(d_tbg, _t(xp, x.beta * x.exp_g))
    # Tinv = (I + A)^-1: dA = -tril(Tinv^T dTinv Tinv^T, -1), with A = diag(beta) kkd. The tril
    # comes from the strictly lower kkd and decay_strict.
    tinv_t = _t(xp, x.tinv)
    neg_da = xp.matmul(xp.matmul(tinv_t, d_tinv), tinv_t)
    neg_da_kkd = neg_da * x.kkd
    dkk = xp.mul(neg_da * x.decay_strict, -x.beta)  # gradient of k k^T (strictly lower)
    dqk = dp * x.decay  # gradient of q k^T
    # D_ij = exp(G_i - G_j): dD * D adds its row sums to dG and takes its column sums away.
    hd_a = xp.mul(neg_da_kkd, -x.beta)  # dD * D through A (= dA * A)
    hd_p = dp * x.p  # dD * D through p (= dp * p)
    rs_a, rs_p, cs_a, cs_p = rowsum(hd_a), rowsum(hd_p), colsum(hd_a), colsum(hd_p)

    qg_dot = xp.sum(dqg * x.q, -1, keepdim=True) * x.exp_g  # <dqg, qg>  [N, B, H, C, 1]
    kd_dot = xp.sum(dkd * x.k, -1, keepdim=True) * x.exp_rest  # <dkd, kd>
    bg = x.beta * x.exp_g
    dbeta = dbeta_tb + dbg_tbg * x.exp_g - rowsum(neg_da_kkd)
    d_big_g = qg_dot - kd_dot + dbg_tbg * bg + rs_a + rs_p - cs_a - cs_p
    d_g_last = xp.sum(kd_dot, 3, keepdim=True) + dgl.reshape(n, b, h, 1, 1) * x.gl  # [N, B, H, 1, 1]
    if masks is None:  # G = cumsum(g), G_last = sum(g)
        dg = _rev_cumsum(xp, d_big_g, 3) + d_g_last
    else:  # G = seg_tril g, G_last its last row
        d_big_g = xp.cat([d_big_g[:, :, :, : c - 1], d_big_g[:, :, :, c - 1 :] + d_g_last], 3)
        dg = xp.matmul(_t(xp, masks.seg_tril), d_big_g)

    dq = xp.matmul(dqk, x.k) + xp.mul(dqg, x.exp_g)
    dk = xp.matmul(dkk + _t(xp, dkk), x.k) + xp.matmul(_t(xp, dqk), x.q)
    dk = dk + xp.matmul(_t(xp, x.tinv_bg), dw) + xp.mul(dkd, x.exp_rest)
    scale = xp.scalar(kdim**-0.5, x.q)
    if x.rq is not None:
        # y = x r with r = rsqrt(|x|^2 + eps) gives dx = r (dy - y <dy, y>). The q kept is
        # q' = s y (s = K^-0.5), so dq = s r (dq' - q' <dq', q'> / s^2). The dot products come from
        # the [C, C] products: <dq', q'> and <dk', k'> summed term by term.
        dq_dot = rs_p + qg_dot
        dk_dot = rs_a + cs_a + cs_p + dbg_tbg * bg + kd_dot
        dq = xp.mul(dq - xp.mul(x.q, dq_dot * xp.scalar(kdim, x.q)), x.rq * scale)
        dk = xp.mul(dk - xp.mul(x.k, dk_dot), x.rk)
    else:
        dq = dq * scale

    def unchunk_qk(y: Tensor) -> Tensor:  # [N, B, H, C, K] -> [B, T, Hk, K], summing repeats
        y = from_chunks(xp, y, seq_len)
        if num_k_heads == h:
            return y
        return xp.sum(y.reshape(b, seq_len, num_k_heads, h // num_k_heads, kdim), 3)

    def unchunk_gate(y: Tensor) -> Tensor:  # [N, B, H, C, 1] -> [B, T, H]
        return from_chunks(xp, y, seq_len).reshape(b, seq_len, h)

    return (
        unchunk_qk(dq),
        unchunk_qk(dk),
        from_chunks(xp, dv, seq_len),
        unchunk_gate(dg),
        unchunk_gate(dbeta),
    )
