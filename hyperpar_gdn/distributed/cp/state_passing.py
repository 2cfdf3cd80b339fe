"""The p2p and all_gather modes: one local pass, an exchange for the entering state, one product.

Both run the same pipeline on the local shard; they differ only in how rank r obtains S_in:

- p2p: S_in arrives from rank r-1, rank r forwards M_r S_in + S_ext_r to rank r+1 (a chain in
  which only this affine step is sequential); backward sends dS_in back to rank r-1.
- all_gather: every rank gathers the packed summaries [S_ext | M] of all ranks and folds those of
  ranks < r; backward reduce-scatters the summaries' gradients to their owners.

One pass, no second output pass (DESIGN.md section 8, :mod:`hyperpar_gdn.ops.onepass`): before
any communication each rank runs its chunks once on the widened state [S | M], which gives the
outputs for a zero entering state o0, the map Q_eff from the entering state to the outputs, and
its summary (S_ext, M). The exchange then finishes the outputs, o = o0 + Q_eff S_in. Rank 0's
entering state is zero, so it runs the plain (width V) pass: its final state is S_ext and it needs
neither Q_eff nor M (M_0 only ever multiplies rank 0's zero entering state).

Each exchange and the product o0 + Q_eff S_in are one hand-written autograd step: every rank's
output depends on it, so every rank joins the backward collective, and its backward computes
dS_in = Q_eff^T do first and sends it on at once (only the affine step waits for the peer).
Shapes: S ``[B, H, K, V]``, M ``[B, H, K, K]``, packed ``[B, H, K, V+K]``, o0 ``[N, B, H, C, V]``,
Q_eff ``[N, B, H, C, K]`` (chunk-major), o ``[B, T_r, H, V]``.
"""

from __future__ import annotations

from hyperpar_gdn.ops import prepare_chunks
from hyperpar_gdn.ops.common import from_chunks, to_chunks
from hyperpar_gdn.ops.layer import finish, gates, head_dims, mask_padding, project, split_heads
from hyperpar_gdn.ops.onepass import OnePass, entering_backward, entering_forward, one_pass
from hyperpar_gdn.platform import Tensor

from .common import CPGroup, LayerCall, ShardDocs, conv_with_halo


def _t(xp, x: Tensor) -> Tensor:
    return xp.swapaxes(x, -1, -2)


def _apply(xp, o0: Tensor, q_eff: Tensor | None, s_in: Tensor, seq_len: int) -> Tensor:
    """o ``[B, T_r, H, V]`` from o0 and Q_eff (None on rank 0, whose entering state is zero)."""
    if q_eff is None:
        return from_chunks(xp, o0, seq_len)
    return entering_forward(xp, o0, q_eff, s_in, seq_len)


def _apply_backward(xp, q_eff: Tensor | None, s_in: Tensor, do: Tensor, chunk_size: int):
    """Gradients of (o0, Q_eff, S_in) of :func:`_apply`; Q_eff's and S_in's are None on rank 0."""
    if q_eff is None:
        return to_chunks(xp, do, chunk_size), None, None
    return entering_backward(xp, q_eff, s_in, do)


def _p2p_forward(cp: CPGroup, seq_len: int, o0: Tensor, s_ext: Tensor, q_eff=None, m=None):
    xp = cp.xp
    if cp.rank == 0:
        s_in = xp.zeros(s_ext.shape, like=s_ext)
        s_out = s_ext
    else:
        s_in = cp.comm.recv(s_ext, cp.rank - 1, cp.group)
        s_out = xp.matmul(m, s_in) + s_ext
    if cp.rank < cp.size - 1:
        cp.comm.send(s_out, cp.rank + 1, cp.group)
    saved = (s_in,) if q_eff is None else (s_in, q_eff, m)
    return (_apply(xp, o0, q_eff, s_in, seq_len),), saved


def _p2p_backward(cp: CPGroup, chunk_size: int, saved, do: Tensor):
    xp = cp.xp
    s_in, q_eff, m = saved if len(saved) == 3 else (saved[0], None, None)
    do0, dq_eff, ds_in = _apply_backward(xp, q_eff, s_in, do, chunk_size)
    if cp.rank < cp.size - 1:
        ds_out = cp.comm.recv(s_in, cp.rank + 1, cp.group)
        d_s_ext = ds_out
        if m is not None:
            ds_in = ds_in + xp.matmul(_t(xp, m), ds_out)
            dm = xp.matmul(ds_out, _t(xp, s_in))
    else:
        d_s_ext = xp.zeros(s_in.shape, like=s_in)
        dm = None if m is None else xp.zeros(m.shape, like=m)
    if cp.rank > 0:
        cp.comm.send(ds_in, cp.rank - 1, cp.group)
    return (do0, d_s_ext) if q_eff is None else (do0, d_s_ext, dq_eff, dm)


def p2p_outputs(cp: CPGroup, passed: OnePass, seq_len: int) -> Tensor:
    """This rank's outputs ``[B, T_r, H, V]`` with the entering state from the chain of ranks
    before it (zeros on rank 0)."""
    chunk_size = passed.o0.shape[3]
    inputs = (passed.o0, passed.s_ext)
    if passed.q_eff is not None:
        inputs += (passed.q_eff, passed.m)
    (o,) = cp.xp.custom_vjp(
        lambda *a: _p2p_forward(cp, seq_len, *a),
        lambda saved, do: _p2p_backward(cp, chunk_size, saved, do),
        *inputs,
    )
    return o


def _fold(cp: CPGroup, gathered: Tensor, dv: int) -> Tensor:
    xp = cp.xp
    s = xp.zeros(gathered[0][..., :dv].shape, like=gathered)
    for j in range(cp.rank):
        s = xp.matmul(gathered[j][..., dv:], s) + gathered[j][..., :dv]
    return s


def _gather_forward(cp: CPGroup, seq_len: int, o0: Tensor, packed: Tensor, q_eff=None):
    dv = o0.shape[-1]
    gathered = cp.comm.all_gather(packed, cp.group)  # [cp, B, H, K, V+K]
    s_in = _fold(cp, gathered, dv)
    saved = (gathered, s_in) if q_eff is None else (gathered, s_in, q_eff)
    return (_apply(cp.xp, o0, q_eff, s_in, seq_len),), saved


def _gather_backward(cp: CPGroup, chunk_size: int, saved, do: Tensor):
    """dS_in from the outputs, reverse the fold (s_{j+1} = M_j s_j + S_ext_j for j < r), then
    reduce-scatter the summaries' gradients to their owners."""
    xp = cp.xp
    gathered, s_in, q_eff = saved if len(saved) == 3 else (*saved, None)
    dv = s_in.shape[-1]
    do0, dq_eff, ds = _apply_backward(xp, q_eff, s_in, do, chunk_size)
    states = [xp.zeros(s_in.shape, like=s_in)]
    for j in range(cp.rank):
        states.append(xp.matmul(gathered[j][..., dv:], states[-1]) + gathered[j][..., :dv])
    grads = [xp.zeros(gathered[0].shape, like=gathered) for _ in range(cp.size)]
    for j in range(cp.rank - 1, -1, -1):
        m_j = gathered[j][..., dv:]
        grads[j] = xp.cat([ds, xp.matmul(ds, _t(xp, states[j]))], -1)
        ds = xp.matmul(_t(xp, m_j), ds)
    received = cp.comm.all_to_all(xp.stack(grads, 0), [1] * cp.size, [1] * cp.size, cp.group)
    d_packed = xp.sum(received, 0)
    return (do0, d_packed) if q_eff is None else (do0, d_packed, dq_eff)


def all_gather_outputs(cp: CPGroup, passed: OnePass, seq_len: int) -> Tensor:
    """This rank's outputs ``[B, T_r, H, V]`` with the entering state folded from all ranks'
    summaries, gathered at once (zeros on rank 0, which sends M = 0: no rank uses M_0)."""
    xp = cp.xp
    chunk_size = passed.o0.shape[3]
    m = passed.m
    if m is None:
        b, h, dk, _ = passed.s_ext.shape
        m = xp.zeros((b, h, dk, dk), like=passed.s_ext)
    packed = xp.cat([passed.s_ext, m], -1)
    inputs = (passed.o0, packed) if passed.q_eff is None else (passed.o0, packed, passed.q_eff)
    (o,) = xp.custom_vjp(
        lambda *a: _gather_forward(cp, seq_len, *a),
        lambda saved, do: _gather_backward(cp, chunk_size, saved, do),
        *inputs,
    )
    return o


OUTPUTS = {"p2p": p2p_outputs, "all_gather": all_gather_outputs}


def state_passing_forward(
    mode: str,
    cp: CPGroup,
    call: LayerCall,
    x: Tensor,
    attention_mask: Tensor | None,
    docs: ShardDocs | None = None,
) -> Tensor:
    """x ``[B, T/cp, hidden]`` (this rank's shard) -> ``[B, T/cp, hidden]``.

    Packed documents (``docs``): the shard's summary is exact across them (M = 0 once a
    document starts in the shard), so the exchange is unchanged; the conv and the local chunks
    restart at every start."""
    xp, w, dims = cp.xp, call.weights, call.dims
    x = mask_padding(xp, x, attention_mask)
    mixed, z, b, a = project(xp, w, x)
    q, k, v = split_heads(conv_with_halo(cp, mixed, w.conv, docs), **head_dims(dims))
    g, beta = gates(xp, b, a, w.a_log, w.dt_bias)
    prep = prepare_chunks(
        q,
        k,
        v,
        g,
        beta,
        chunk_size=call.chunk_size,
        use_qk_l2norm_in_kernel=True,
        doc_starts=None if docs is None else docs.local,
    )
    passed = one_pass(prep, widened=cp.rank > 0)
    o = xp.cast(OUTPUTS[mode](cp, passed, prep.seq_len), prep.out_dtype)
    return finish(xp, w, dims, o, z)
