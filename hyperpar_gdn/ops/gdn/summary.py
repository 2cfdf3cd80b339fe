"""State summaries: the affine map a segment of tokens applies to the state entering it.

For a segment, S_out = M @ S_in + S_ext with M ``[B, H, K, K]`` and S_ext ``[B, H, K, V]``.
Running the chunk recurrence on the widened state [S | M] from [0 | I] with values [u | 0]
yields [S_ext | M] in one pass (the V and K columns evolve independently).

With packed documents the prepared chunks already carry the cuts (see
:func:`hyperpar_gdn.ops.prepare_chunks`), so the same pass is exact: past a cut the widened state
restarts from [0 | 0], which makes M = 0 for a segment that contains a cut and S_ext the state
built from the last cut on.
"""

from __future__ import annotations

from typing import Any

from hyperpar_gdn.ops.gdn.chunk import ChunkPrep, prepare_chunks
from hyperpar_gdn.ops.gdn.recurrence import chunk_final_state
from hyperpar_gdn.platform import Tensor, ops_for

Summary = tuple[Tensor, Tensor]  # (S_ext [B, H, K, V], M [B, H, K, K])


def summary_from(prep: ChunkPrep) -> Summary:
    """The summary (S_ext, M) of a prepared segment, in the compute dtype (fp32 or fp64).

    Its backward recomputes the per-chunk states instead of keeping them."""
    xp = prep.xp
    b, h, dk, dv = prep.state_shape
    n, c = prep.u.shape[0], prep.u.shape[3]
    u_wide = xp.cat([prep.u, xp.zeros((n, b, h, c, dk), like=prep.u)], -1)
    eye = xp.eye(dk, like=prep.u).reshape(1, 1, dk, dk) + xp.zeros((b, h, dk, dk), like=prep.u)
    x0 = xp.cat([xp.zeros((b, h, dk, dv), like=prep.u), eye], -1)
    x = chunk_final_state(xp, u_wide, prep.w, prep.kd, prep.gl, x0)
    return x[..., :dv], x[..., dv:]


def gdn_state_summary(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    chunk_size: int = 64,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Any = None,
    doc_starts: Any = None,
) -> Summary:
    """Summary of the segment q, k ``[B, T, Hk, K]``, v ``[B, T, H, V]``, g, beta ``[B, T, H]``.

    Returns (S_ext ``[B, H, K, V]``, M ``[B, H, K, K]``) in fp32 (fp64 for fp64 input), such that
    the final state from any S_in is ``apply_summary((S_ext, M), S_in) = M @ S_in + S_ext``.

    Packed documents (B = 1), as in :func:`hyperpar_gdn.ops.prepare_chunks`: with ``cu_seqlens``
    S_in is document 0's initial state and the final state document N-1's (M = 0 when N > 1);
    with ``doc_starts`` M = 0 as soon as any token starts a document.
    """
    prep = prepare_chunks(
        q,
        k,
        v,
        g,
        beta,
        chunk_size=chunk_size,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens,
        doc_starts=doc_starts,
    )
    return summary_from(prep)


def apply_summary(summary: Summary, state: Tensor) -> Tensor:
    """The state leaving a segment entered with ``state`` ``[B, H, K, V]``: M @ state + S_ext."""
    s_ext, m = summary
    return ops_for(m).matmul(m, state) + s_ext


def compose_summaries(first: Summary, second: Summary) -> Summary:
    """Summary of segment ``first`` followed by segment ``second``: (M2 S1 + S2, M2 M1)."""
    (s1, m1), (s2, m2) = first, second
    xp = ops_for(m1)
    return xp.matmul(m2, s1) + s2, xp.matmul(m2, m1)
