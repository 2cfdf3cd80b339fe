"""Input checks, preprocessing and layout changes shared by the gated-delta-rule functions.

Legend: B batch, T tokens, Hk query/key heads, H value heads, K key dim, V value dim, N chunks,
C chunk size, D any last dim.
"""

from __future__ import annotations

from collections.abc import Callable

from hyperpar_gdn.platform import Tensor, TensorOps, ops_for

L2NORM_EPS = 1e-6


def check_inputs(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None
) -> None:
    """Raise ValueError, naming the shapes, unless q, k ``[B, T, Hk, K]``, v ``[B, T, H, V]``,
    g, beta ``[B, T, H]`` with H a multiple of Hk, and initial_state ``[B, H, K, V]``."""
    if len(q.shape) != 4 or tuple(k.shape) != tuple(q.shape):
        raise ValueError(f"q and k must both be [B, T, Hk, K]; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    b, t, hk, dk = q.shape
    if len(v.shape) != 4 or tuple(v.shape[:2]) != (b, t):
        raise ValueError(f"v must be [B={b}, T={t}, H, V]; got {tuple(v.shape)}")
    h, dv = v.shape[2], v.shape[3]
    if h % hk:
        raise ValueError(f"value heads H={h} must be a multiple of query/key heads Hk={hk}")
    for name, x in (("g", g), ("beta", beta)):
        if tuple(x.shape) != (b, t, h):
            raise ValueError(f"{name} must be [B, T, H] = {(b, t, h)}; got {tuple(x.shape)}")
    if initial_state is not None and tuple(initial_state.shape) != (b, h, dk, dv):
        raise ValueError(
            f"initial_state must be [B, H, K, V] = {(b, h, dk, dv)}; got {tuple(initial_state.shape)}"
        )


def check_document_states(
    initial_state: Tensor | None, num_docs: int, num_heads: int, key_dim: int, value_dim: int
) -> None:
    """Raise ValueError unless ``initial_state`` is None or per document, ``[N, H, K, V]``."""
    expected = (num_docs, num_heads, key_dim, value_dim)
    if initial_state is not None and tuple(initial_state.shape) != expected:
        raise ValueError(
            f"with cu_seqlens, initial_state must be [N, H, K, V] = {expected} (one state per document); "
            f"got {tuple(initial_state.shape)}"
        )


def l2norm(xp: TensorOps, x: Tensor) -> Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim."""
    return x * xp.rsqrt(xp.sum(x * x, -1, keepdim=True) + xp.scalar(L2NORM_EPS, x))


def prepare_qkv(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, use_qk_l2norm_in_kernel: bool
) -> tuple[TensorOps, tuple[Tensor, ...]]:
    """Cast to the compute dtype, repeat q/k heads to H (interleaved: value head j reads q/k head
    j // (H / Hk)), l2-normalise q and k if asked, scale q by K^-0.5. Returns the tensor functions
    and (q, k ``[B, T, H, K]``, v ``[B, T, H, V]``, g, beta ``[B, T, H]``)."""
    xp = ops_for(q)
    dtype = xp.compute_dtype(q)
    q, k, v, g, beta = (xp.cast(x, dtype) for x in (q, k, v, g, beta))
    groups = v.shape[2] // q.shape[2]
    q = xp.repeat_interleave(q, groups, 2)
    k = xp.repeat_interleave(k, groups, 2)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(xp, q), l2norm(xp, k)
    q = q * xp.scalar(q.shape[-1] ** -0.5, q)
    return xp, (q, k, v, g, beta)


def to_chunks(xp: TensorOps, x: Tensor, chunk_size: int) -> Tensor:
    """``[B, T, H, D]`` -> chunk-major ``[N, B, H, C, D]`` (contiguous), zero-padding T up to N * C."""
    b, t, h, d = x.shape
    n = -(-t // chunk_size)
    x = xp.pad_dim(x, 1, 0, n * chunk_size - t).reshape(b, n, chunk_size, h, d)
    return xp.permute(x, (1, 0, 3, 2, 4))


def from_chunks(xp: TensorOps, x: Tensor, seq_len: int) -> Tensor:
    """Chunk-major ``[N, B, H, C, D]`` -> ``[B, T, H, D]`` (contiguous up to the padding, which is
    sliced off: T = ``seq_len``)."""
    n, b, h, c, d = x.shape
    x = xp.permute(x, (1, 0, 3, 2, 4)).reshape(b, n * c, h, d)
    return x if seq_len == n * c else x[:, :seq_len]


# With ``flush``, the state loops zero subnormal entries every FLUSH_EVERY chunks rather than every
# chunk: a decaying product stays subnormal for many chunks (fp32 spans a factor 2^23 below the
# smallest normal), so this catches nearly all of them at a quarter of the elementwise passes
# (measured: flushing every chunk cost ~8% of the widened one-pass recurrence).
FLUSH_EVERY = 4


def subnormal_keeper(xp: TensorOps, flush: bool) -> Callable[[Tensor, int], Tensor]:
    """``keep(x, i)``: x, with its subnormal entries zeroed at every FLUSH_EVERY-th chunk i when
    ``flush`` (every state loop, readable or batched, flushes on the same chunks)."""
    if not flush:
        return lambda x, i: x
    return lambda x, i: xp.flush_subnormal(x) if i % FLUSH_EVERY == 0 else x
