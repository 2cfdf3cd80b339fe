"""One pass for a segment's outputs and its summary (DESIGN.md section 8), for context parallelism.

A shard of a sequence does not know the state S_in entering it until other ranks have run. Its
outputs are affine in S_in, o = o0 + Q_eff S_in, and so is the state leaving it,
S_out = M S_in + S_ext. One chunk recurrence on the widened state X = [S | M] ``[B, H, K, V+K]``
from [0 | I], with values [u | 0], gives all four at once: the V columns of its outputs are o0
(the outputs for a zero entering state), the K columns are Q_eff, and the final X is the summary
[S_ext | M]. Once S_in is known, a ``[C, K] x [K, V]`` product per chunk and head finishes the
outputs (:func:`apply_entering_state`); there is no second output pass.

A segment that no other state enters (the first shard) needs neither Q_eff nor M: it runs the
plain width-V pass (``widened=False``); its final state is S_ext.

Packed documents need nothing more: past a cut the prepared chunks (``first``/``last`` masks,
:mod:`hyperpar_gdn.ops.chunk`) zero the rows of Q_eff and the columns of M, exactly as they
stop the true entering state.

Legend: N chunks, B batch, H value heads, C chunk size, K key dim, V value dim, T tokens.
"""

from __future__ import annotations

from typing import NamedTuple

from hyperpar_gdn.platform import Tensor, TensorOps

from .chunk import ChunkPrep
from .common import from_chunks, to_chunks
from .recurrence import backward_states, forward_states


class OnePass(NamedTuple):
    """The outputs of a segment as an affine function of the state entering it, and its summary
    (compute dtype, chunk-major)."""

    o0: Tensor  # [N, B, H, C, V]  outputs for a zero entering state
    q_eff: Tensor | None  # [N, B, H, C, K]  o = o0 + q_eff @ S_in; None when not widened
    s_ext: Tensor  # [B, H, K, V]  the state leaving the segment from a zero entering state
    m: Tensor | None  # [B, H, K, K]  S_out = m @ S_in + s_ext; None when not widened


def _t(xp: TensorOps, x: Tensor) -> Tensor:
    return xp.swapaxes(x, -1, -2)


def _entering(xp: TensorOps, u: Tensor, dk: int, widened: bool) -> tuple[Tensor, Tensor]:
    """The values ``[N, B, H, C, W]`` and the one entry ``[1, B, H, K, W]`` of the recurrence:
    ([u | 0], [0 | I]) with W = V + K when widened, else (u, 0) with W = V."""
    n, b, h, c, dv = u.shape
    if not widened:
        return u, xp.zeros((1, b, h, dk, dv), like=u)
    u_wide = xp.cat([u, xp.zeros((n, b, h, c, dk), like=u)], -1)
    eye = xp.eye(dk, like=u).reshape(1, 1, 1, dk, dk) + xp.zeros((1, b, h, dk, dk), like=u)
    return u_wide, xp.cat([xp.zeros((1, b, h, dk, dv), like=u), eye], -1)


def _forward(xp: TensorOps, qg, p, u, w, kd, gl, *, widened: bool):
    dv, dk = u.shape[-1], w.shape[-1]
    values, entry = _entering(xp, u, dk, widened)
    # The widened state's M columns are products of decays, which sink into subnormal floats.
    states, vn, exits = forward_states(xp, values, w, kd, gl, entry, flush=widened)
    x = exits[0]
    saved = (qg, p, w, kd, gl, states, vn)
    if not widened:
        return (xp.matmul(qg, states) + xp.matmul(p, vn), x), saved
    # o0 and Q_eff in tensors of their own: Q_eff is kept for the backward, and a view into the
    # widened outputs [N, B, H, C, V+K] would keep all of them alive.
    o0 = xp.matmul(qg, states[..., :dv]) + xp.matmul(p, vn[..., :dv])
    q_eff = xp.matmul(qg, states[..., dv:]) + xp.matmul(p, vn[..., dv:])
    return (o0, q_eff, x[..., :dv], x[..., dv:]), saved


def _backward(xp: TensorOps, saved, *grads, widened: bool):
    qg, p, w, kd, gl, states, vn = saved
    if widened:
        do0, dq_eff, ds_ext, dm = grads
        do, dx = xp.cat([do0, dq_eff], -1), xp.cat([ds_ext, dm], -1)
    else:
        do, dx = grads
    dx = dx.reshape((1,) + tuple(dx.shape))
    du, dw, dkd, dgl, _ = backward_states(xp, states, vn, w, kd, gl, dx, (qg, p, do), flush=widened)
    dqg = xp.matmul(do, _t(xp, states))
    dp = xp.matmul(do, _t(xp, vn))
    if widened:
        du = du[..., : do0.shape[-1]]
    return dqg, dp, du, dw, dkd, dgl


def one_pass(prep: ChunkPrep, *, widened: bool = True) -> OnePass:
    """o0, Q_eff and the summary (S_ext, M) of a prepared segment in one chunk recurrence.

    ``widened=False``: a segment entered by a zero state only (the first shard): the plain pass,
    with ``q_eff`` and ``m`` None. Differentiable (hand-written backward: the widened recurrence's
    reverse loop, with the gradients of o0 and Q_eff as the outputs' gradient and those of
    [S_ext | M] as the final state's)."""
    xp = prep.xp
    outs = xp.custom_vjp(
        lambda *a: _forward(xp, *a, widened=widened),
        lambda saved, *g: _backward(xp, saved, *g, widened=widened),
        prep.qg,
        prep.p,
        prep.u,
        prep.w,
        prep.kd,
        prep.gl,
    )
    if not widened:
        return OnePass(o0=outs[0], q_eff=None, s_ext=outs[1], m=None)
    return OnePass(*outs)


def entering_forward(xp: TensorOps, o0: Tensor, q_eff: Tensor, s_in: Tensor, seq_len: int) -> Tensor:
    """o ``[B, T, H, V]`` = o0 + Q_eff S_in (chunk-major o0, Q_eff; S_in ``[B, H, K, V]``)."""
    return from_chunks(xp, o0 + xp.matmul(q_eff, s_in), seq_len)


def entering_backward(
    xp: TensorOps, q_eff: Tensor, s_in: Tensor, do: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of (o0, Q_eff ``[N, B, H, C, *]``, S_in ``[B, H, K, V]``) of
    :func:`entering_forward` from do ``[B, T, H, V]``: dS_in = sum over chunks of Q_eff^T do."""
    do = to_chunks(xp, do, q_eff.shape[3])
    return do, xp.matmul(do, _t(xp, s_in)), xp.sum(xp.matmul(_t(xp, q_eff), do), 0)


def apply_entering_state(passed: OnePass, s_in: Tensor | None, *, seq_len: int) -> Tensor:
    """The segment's outputs ``[B, T, H, V]`` (compute dtype; T = ``seq_len``) entered with
    ``s_in`` ``[B, H, K, V]`` (None: zero, the only choice when ``passed`` is not widened)."""
    from hyperpar_gdn.platform import ops_for

    xp = ops_for(passed.o0)
    if s_in is None:
        return from_chunks(xp, passed.o0, seq_len)
    if passed.q_eff is None:
        raise ValueError("an entering state needs a widened pass (one_pass(prep, widened=True))")
    (o,) = xp.custom_vjp(
        lambda o0, q, s: ((entering_forward(xp, o0, q, s, seq_len),), (q, s)),
        lambda saved, do: entering_backward(xp, *saved, do),
        passed.o0,
        passed.q_eff,
        s_in,
    )
    return o
