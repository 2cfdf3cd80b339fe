"""The sequential part of the chunked gated delta rule, with a hand-written backward.

Everything state-independent (gates, decay masks, the triangular inverse) is computed batched over
chunks by :mod:`hyperpar_gdn.ops.gdn.chunk`; only the chunk-to-chunk state recurrence runs in a Python
loop here. Autograd never sees the loop: slicing chunk ``i`` out of whole tensors under autograd
costs a full-size zero gradient per slice, which is where a naive chunked version spends its time.

Shapes (chunk-major: chunk i is the contiguous block x[i]), with N chunks of C tokens:

    qg, w, kd  [N, B, H, C, K]     q*exp(G), Tinv(beta*exp(G)*k), k*exp(G_last - G)
    P          [N, B, H, C, C]     tril(q k^T * D)
    u          [N, B, H, C, V]     Tinv(beta*v)
    gl         [N, B, H]           exp(G_last)
    S          [B, H, K, V]        the state entering a chunk

Per chunk i:  vn = u_i - w_i S;  o_i = qg_i S + P_i vn;  S <- gl_i S + kd_i^T vn.

Packed documents reach this loop in two ways (see :mod:`hyperpar_gdn.ops.gdn.chunk`): cuts inside
chunks are already in the masked qg, w, kd, gl; in the document-aligned layout a document starts
at a chunk, where the loop replaces the carried state by that document's initial state (an
"entry") and keeps the state it replaces (an "exit", the previous document's final state).
"""

from __future__ import annotations

from hyperpar_gdn.ops.gdn.common import from_chunks, subnormal_keeper, to_chunks
from hyperpar_gdn.ops.gdn.recurrence_batched import backward_states_batched, reverse_state_loop
from hyperpar_gdn.platform.base import Tensor, TensorOps


def _t(xp: TensorOps, x: Tensor) -> Tensor:
    return xp.swapaxes(x, -1, -2)


def forward_states(
    xp: TensorOps,
    u: Tensor,
    w: Tensor,
    kd: Tensor,
    gl: Tensor,
    entries: Tensor,
    *,
    entry_chunks: tuple[int, ...] = (),
    flush: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Run the state recurrence. ``entries`` ``[E, B, H, K, V]``: entries[0] enters chunk 0 and
    entries[e] replaces the state entering chunk ``entry_chunks[e - 1]`` (a document starts there;
    E = 1 + len(entry_chunks)).

    Returns (states entering each chunk ``[N, B, H, K, V]``, corrected values vn
    ``[N, B, H, C, V]``, exits ``[E, B, H, K, V]``): exits[e] is the state leaving the chunk
    before ``entry_chunks[e]`` (the state a new entry replaced), exits[-1] the final state.

    ``flush`` zeroes subnormal entries of the carried state and of vn every FLUSH_EVERY steps
    (:meth:`TensorOps.flush_subnormal`): the summary's M is a product of decays that sinks there."""
    n = u.shape[0]
    kd_t = _t(xp, kd)
    gl = gl.reshape(gl.shape + (1, 1))
    keep = subnormal_keeper(xp, flush)
    entry_of = {c: e for e, c in enumerate(entry_chunks, 1)}
    s, states, vns, exits = entries[0], [], [], []
    for i in range(n):
        if i in entry_of:
            exits.append(s)
            s = entries[entry_of[i]]
        vn = keep(u[i] - xp.matmul(w[i], s), i)
        states.append(s)
        vns.append(vn)
        s = keep(xp.mul(gl[i], s) + xp.matmul(kd_t[i], vn), i)
    exits.append(s)
    return xp.stack(states, 0), xp.stack(vns, 0), xp.stack(exits, 0)


def backward_states(
    xp: TensorOps,
    states: Tensor,
    vn: Tensor,
    w: Tensor,
    kd: Tensor,
    gl: Tensor,
    d_exits: Tensor,
    outputs: tuple[Tensor, Tensor, Tensor] | None = None,
    *,
    entry_chunks: tuple[int, ...] = (),
    flush: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Reverse loop of :func:`forward_states`, given its ``states`` and ``vn``, from the gradient
    ``d_exits`` ``[E, B, H, K, V]`` of its exits.

    Returns the gradients of u ``[N, B, H, C, V]`` (= that of vn), w and kd ``[N, B, H, C, K]``,
    gl ``[N, B, H]`` and the entries ``[E, B, H, K, V]``. Those of kd and gl need the gradient
    of the state leaving each chunk, so they are taken inside the loop rather than from a stacked
    ``[N, B, H, K, V]`` tensor.

    ``outputs`` = (qg, p, do) when the chunk outputs o_i = qg_i S + p_i vn were taken too: do
    ``[N, B, H, C, V]`` then also reaches vn (p_i^T do_i) and S (qg_i^T do_i), added in the loop.
    ``entry_chunks`` and ``flush`` as in :func:`forward_states`.
    """
    if xp.prefers_batched_loops:  # the same sums with the per-chunk work batched (MindSpore)
        return backward_states_batched(
            xp, states, vn, w, kd, gl, d_exits, outputs, entry_chunks=entry_chunks, flush=flush
        )
    n = w.shape[0]
    gl = gl.reshape(gl.shape + (1, 1))
    dkds: list[Tensor] = [None] * n  # type: ignore[list-item]
    dgls: list[Tensor] = [None] * n  # type: ignore[list-item]

    def leaving(i: int, ds: Tensor) -> None:  # the gradients of kd_i and gl_i need this ds
        dkds[i] = xp.matmul(vn[i], _t(xp, ds))
        dgls[i] = xp.sum(states[i] * ds, (-2, -1))

    extra = {"dvn_extra": None, "ds_extra": None}
    if outputs is not None:
        qg, p, do = outputs
        qg_t, p_t = _t(xp, qg), _t(xp, p)
        extra = {
            "dvn_extra": lambda i: xp.matmul(p_t[i], do[i]),
            "ds_extra": lambda i: xp.matmul(qg_t[i], do[i]),
        }
    dvns, d_entries = reverse_state_loop(
        xp, w, kd, gl, d_exits, on_leaving=leaving, entry_chunks=entry_chunks, flush=flush, **extra
    )
    dvn = xp.stack(dvns, 0)
    dw = -xp.matmul(dvn, _t(xp, states))
    return dvn, dw, xp.stack(dkds, 0), xp.stack(dgls, 0), xp.stack(d_entries, 0)


def outputs_forward(
    xp: TensorOps, qg, p, u, w, kd, gl, entries, *, seq_len: int, entry_chunks: tuple[int, ...] = ()
) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, ...]]:
    """Outputs o ``[B, T, H, V]`` (T = ``seq_len``) and the exits, and what the backward needs
    (the states entering each chunk and the corrected values)."""
    states, vn, exits = forward_states(xp, u, w, kd, gl, entries, entry_chunks=entry_chunks)
    o = xp.matmul(qg, states) + xp.matmul(p, vn)
    return (from_chunks(xp, o, seq_len), exits), (qg, p, w, kd, gl, states, vn)


def outputs_backward(
    xp: TensorOps,
    saved: tuple[Tensor, ...],
    do: Tensor,
    d_exits: Tensor,
    *,
    entry_chunks: tuple[int, ...] = (),
) -> tuple[Tensor, ...]:
    """Gradients of (qg, p, u, w, kd, gl, entries) from do ``[B, T, H, V]`` and d exits."""
    qg, p, w, kd, gl, states, vn = saved
    do = to_chunks(xp, do, qg.shape[3])  # [N, B, H, C, V], contiguous
    du, dw, dkd, dgl, d_entries = backward_states(
        xp, states, vn, w, kd, gl, d_exits, (qg, p, do), entry_chunks=entry_chunks
    )
    dqg = xp.matmul(do, _t(xp, states))
    dp = xp.matmul(do, _t(xp, vn))
    return dqg, dp, du, dw, dkd, dgl, d_entries


def chunk_outputs(
    xp: TensorOps,
    qg: Tensor,
    p: Tensor,
    u: Tensor,
    w: Tensor,
    kd: Tensor,
    gl: Tensor,
    entries: Tensor,
    *,
    seq_len: int,
    entry_chunks: tuple[int, ...] = (),
) -> tuple[Tensor, Tensor]:
    """Outputs ``[B, T, H, V]`` (the first ``seq_len`` tokens) and exits ``[E, B, H, K, V]`` of
    the chunks, with the states ``entries`` ``[E, B, H, K, V]`` entering chunk 0 and the
    ``entry_chunks`` (see :func:`forward_states`). The states entering each chunk are kept for
    the backward."""
    return xp.custom_vjp(
        lambda *a: outputs_forward(xp, *a, seq_len=seq_len, entry_chunks=entry_chunks),
        lambda saved, do, d_exits: outputs_backward(xp, saved, do, d_exits, entry_chunks=entry_chunks),
        qg,
        p,
        u,
        w,
        kd,
        gl,
        entries,
    )


def _final_forward(xp: TensorOps, u, w, kd, gl, s0):
    _, _, exits = forward_states(xp, u, w, kd, gl, _one(s0), flush=True)
    return (exits[0],), (u, w, kd, gl, s0)


def _final_backward(xp: TensorOps, saved, ds_final):
    u, w, kd, gl, s0 = saved
    states, vn, _ = forward_states(xp, u, w, kd, gl, _one(s0), flush=True)  # recomputed rather than kept
    du, dw, dkd, dgl, d_entries = backward_states(xp, states, vn, w, kd, gl, _one(ds_final), flush=True)
    return du, dw, dkd, dgl, d_entries[0]


def _one(s: Tensor) -> Tensor:
    """``[B, H, K, V]`` -> one entry ``[1, B, H, K, V]``."""
    return s.reshape((1,) + tuple(s.shape))


def chunk_final_state(xp: TensorOps, u: Tensor, w: Tensor, kd: Tensor, gl: Tensor, s0: Tensor) -> Tensor:
    """Only the final state (no outputs) from ``s0`` ``[B, H, K, V]``; the per-chunk states are
    recomputed in backward. Used for summaries, whose M decays towards subnormal floats: the loops
    flush them."""
    (s_final,) = xp.custom_vjp(
        lambda *a: _final_forward(xp, *a),
        lambda saved, ds: _final_backward(xp, saved, ds),
        u,
        w,
        kd,
        gl,
        s0,
    )
    return s_final
