"""The sequential part of the chunked gated delta rule, with a hand-written backward.

Everything state-independent (gates, decay masks, the triangular solve) is computed batched over
chunks by :mod:`hyperpar_gdn.ops.chunk`; only the chunk-to-chunk state recurrence runs in a Python
loop here. Autograd never sees the loop: slicing chunk ``i`` out of whole tensors under autograd
costs a full-size zero gradient per slice, which is where a naive chunked version spends its time.

Shapes (chunk-major: chunk i is the contiguous block x[i]), with N chunks of C tokens:

    qg, w, kd  [N, B, H, C, K]     q*exp(G), T(beta*exp(G)*k), k*exp(G_last - G)
    P          [N, B, H, C, C]     tril(q k^T * D)
    u          [N, B, H, C, V]     T(beta*v)
    gl         [N, B, H]           exp(G_last)
    S          [B, H, K, V]        the state entering a chunk

Per chunk i:  vn = u_i - w_i S;  o_i = qg_i S + P_i vn;  S <- gl_i S + kd_i^T vn.
"""

from __future__ import annotations

from hyperpar_gdn.platform.base import Tensor, TensorOps


def _t(xp: TensorOps, x: Tensor) -> Tensor:
    return xp.swapaxes(x, -1, -2)


def forward_states(
    xp: TensorOps, u: Tensor, w: Tensor, kd: Tensor, gl: Tensor, s0: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Run the state recurrence. Returns (states entering each chunk ``[N, B, H, K, V]``,
    corrected values vn ``[N, B, H, C, V]``, final state ``[B, H, K, V]``)."""
    n = u.shape[0]
    kd_t = _t(xp, kd)
    gl = gl.reshape(gl.shape + (1, 1))
    s, states, vns = s0, [], []
    for i in range(n):
        vn = u[i] - xp.matmul(w[i], s)
        states.append(s)
        vns.append(vn)
        s = gl[i] * s + xp.matmul(kd_t[i], vn)
    return xp.stack(states, 0), xp.stack(vns, 0), s


def backward_states(
    xp: TensorOps,
    w: Tensor,
    kd: Tensor,
    gl: Tensor,
    d_final: Tensor,
    dvn_extra: Tensor | None = None,
    ds_extra: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Reverse loop of :func:`forward_states`.

    ``dvn_extra`` ``[N, B, H, C, V]`` and ``ds_extra`` ``[N, B, H, K, V]`` are gradients that reach
    vn and S directly (from the outputs). Returns (d vn ``[N, B, H, C, V]``, d state leaving each
    chunk ``[N, B, H, K, V]``, d initial state ``[B, H, K, V]``).
    """
    n = w.shape[0]
    w_t = _t(xp, w)
    gl = gl.reshape(gl.shape + (1, 1))
    ds = d_final
    dvns: list[Tensor] = [None] * n  # type: ignore[list-item]
    ds_next: list[Tensor] = [None] * n  # type: ignore[list-item]
    for i in range(n - 1, -1, -1):
        ds_next[i] = ds
        dvn = xp.matmul(kd[i], ds)
        if dvn_extra is not None:
            dvn = dvn + dvn_extra[i]
        ds = gl[i] * ds - xp.matmul(w_t[i], dvn)
        if ds_extra is not None:
            ds = ds + ds_extra[i]
        dvns[i] = dvn
    return xp.stack(dvns, 0), xp.stack(ds_next, 0), ds


def _state_input_grads(
    xp: TensorOps, states: Tensor, vn: Tensor, dvn: Tensor, ds_next: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of (u, w, kd, gl) given the loop's saved and reverse quantities."""
    states_t = _t(xp, states)
    dw = -xp.matmul(dvn, states_t)
    dkd = xp.matmul(vn, _t(xp, ds_next))
    dgl = xp.sum(states * ds_next, (-2, -1))
    return dvn, dw, dkd, dgl


def _outputs_forward(xp: TensorOps, qg, p, u, w, kd, gl, s0):
    states, vn, s_final = forward_states(xp, u, w, kd, gl, s0)
    o = xp.matmul(qg, states) + xp.matmul(p, vn)
    return (o, s_final), (qg, p, w, kd, gl, states, vn)


def _outputs_backward(xp: TensorOps, saved, do, ds_final):
    qg, p, w, kd, gl, states, vn = saved
    dvn, ds_next, ds0 = backward_states(
        xp, w, kd, gl, ds_final, xp.matmul(_t(xp, p), do), xp.matmul(_t(xp, qg), do)
    )
    du, dw, dkd, dgl = _state_input_grads(xp, states, vn, dvn, ds_next)
    dqg = xp.matmul(do, _t(xp, states))
    dp = xp.matmul(do, _t(xp, vn))
    return dqg, dp, du, dw, dkd, dgl, ds0


def chunk_outputs(
    xp: TensorOps, qg: Tensor, p: Tensor, u: Tensor, w: Tensor, kd: Tensor, gl: Tensor, s0: Tensor
) -> tuple[Tensor, Tensor]:
    """Outputs ``[N, B, H, C, V]`` and final state of the chunks, entering with state ``s0``.
    The states entering each chunk are kept for the backward."""
    return xp.custom_vjp(
        lambda *a: _outputs_forward(xp, *a),
        lambda saved, do, ds: _outputs_backward(xp, saved, do, ds),
        qg,
        p,
        u,
        w,
        kd,
        gl,
        s0,
    )


def _final_forward(xp: TensorOps, u, w, kd, gl, s0):
    _, _, s_final = forward_states(xp, u, w, kd, gl, s0)
    return (s_final,), (u, w, kd, gl, s0)


def _final_backward(xp: TensorOps, saved, ds_final):
    u, w, kd, gl, s0 = saved
    states, vn, _ = forward_states(xp, u, w, kd, gl, s0)  # recomputed rather than kept
    dvn, ds_next, ds0 = backward_states(xp, w, kd, gl, ds_final)
    return (*_state_input_grads(xp, states, vn, dvn, ds_next), ds0)


def chunk_final_state(xp: TensorOps, u: Tensor, w: Tensor, kd: Tensor, gl: Tensor, s0: Tensor) -> Tensor:
    """Only the final state (no outputs); the per-chunk states are recomputed in backward."""
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
