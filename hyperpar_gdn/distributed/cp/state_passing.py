"""The p2p and all_gather modes: local summaries, an exchange for the entering state, local chunks.

Both run the same pipeline on the local shard; they differ only in how rank r obtains S_in:

- p2p: S_in arrives from rank r-1, rank r forwards M_r S_in + S_ext_r to rank r+1 (a chain in
  which only this affine step is sequential); backward sends dS_in back to rank r-1.
- all_gather: every rank gathers the packed summaries [S_ext | M] of all ranks and folds those of
  ranks < r; backward reduce-scatters the summaries' gradients to their owners.

Each exchange is one hand-written autograd step so that every rank joins the backward collective
(rank 0's S_in is zeros, yet it must still receive its summary's gradient).
Shapes: S ``[B, H, K, V]``, M ``[B, H, K, K]``, packed ``[B, H, K, V+K]``.
"""

from __future__ import annotations

from hyperpar_gdn.ops import outputs_from, prepare_chunks, summary_from
from hyperpar_gdn.ops.layer import finish, gates, head_dims, mask_padding, project, split_heads
from hyperpar_gdn.platform import Tensor

from .common import CPGroup, LayerCall, ShardDocs, conv_with_halo


def _p2p_forward(cp: CPGroup, s_ext: Tensor, m: Tensor):
    xp = cp.xp
    if cp.rank == 0:
        s_in = xp.zeros(s_ext.shape, like=s_ext)
    else:
        s_in = cp.comm.recv(s_ext, cp.rank - 1, cp.group)
    if cp.rank < cp.size - 1:
        cp.comm.send(xp.matmul(m, s_in) + s_ext, cp.rank + 1, cp.group)
    return (s_in,), (m, s_in)


def _p2p_backward(cp: CPGroup, saved, ds_in: Tensor):
    xp = cp.xp
    m, s_in = saved
    if cp.rank < cp.size - 1:
        ds_out = cp.comm.recv(s_in, cp.rank + 1, cp.group)
        ds_in = ds_in + xp.matmul(xp.swapaxes(m, -1, -2), ds_out)
        d_s_ext, d_m = ds_out, xp.matmul(ds_out, xp.swapaxes(s_in, -1, -2))
    else:
        d_s_ext, d_m = xp.zeros(s_in.shape, like=s_in), xp.zeros(m.shape, like=m)
    if cp.rank > 0:
        cp.comm.send(ds_in, cp.rank - 1, cp.group)
    return d_s_ext, d_m


def p2p_entering_state(cp: CPGroup, s_ext: Tensor, m: Tensor) -> Tensor:
    """S_in of this rank from the chain of ranks before it (zeros on rank 0)."""
    (s_in,) = cp.xp.custom_vjp(
        lambda s, mm: _p2p_forward(cp, s, mm),
        lambda saved, ds: _p2p_backward(cp, saved, ds),
        s_ext,
        m,
    )
    return s_in


def _fold(cp: CPGroup, gathered: Tensor, dv: int) -> Tensor:
    xp = cp.xp
    s = xp.zeros(gathered[0][..., :dv].shape, like=gathered)
    for j in range(cp.rank):
        s = xp.matmul(gathered[j][..., dv:], s) + gathered[j][..., :dv]
    return s


def _gather_forward(cp: CPGroup, packed: Tensor, dv: int):
    gathered = cp.comm.all_gather(packed, cp.group)  # [cp, B, H, K, V+K]
    return (_fold(cp, gathered, dv),), (gathered,)


def _gather_backward(cp: CPGroup, saved, ds_in: Tensor, dv: int):
    """Reverse the fold: s_{j+1} = M_j s_j + S_ext_j for j < r, then reduce-scatter."""
    xp = cp.xp
    (gathered,) = saved
    states = [xp.zeros(ds_in.shape, like=ds_in)]
    for j in range(cp.rank):
        states.append(xp.matmul(gathered[j][..., dv:], states[-1]) + gathered[j][..., :dv])
    grads = [xp.zeros(gathered[0].shape, like=gathered) for _ in range(cp.size)]
    ds = ds_in
    for j in range(cp.rank - 1, -1, -1):
        m_j = gathered[j][..., dv:]
        grads[j] = xp.cat([ds, xp.matmul(ds, xp.swapaxes(states[j], -1, -2))], -1)
        ds = xp.matmul(xp.swapaxes(m_j, -1, -2), ds)
    received = cp.comm.all_to_all(xp.stack(grads, 0), [1] * cp.size, [1] * cp.size, cp.group)
    return (xp.sum(received, 0),)


def all_gather_entering_state(cp: CPGroup, s_ext: Tensor, m: Tensor) -> Tensor:
    """S_in of this rank from all ranks' summaries, gathered at once (zeros on rank 0)."""
    xp = cp.xp
    dv = s_ext.shape[-1]
    (s_in,) = xp.custom_vjp(
        lambda packed: _gather_forward(cp, packed, dv),
        lambda saved, ds: _gather_backward(cp, saved, ds, dv),
        xp.cat([s_ext, m], -1),
    )
    return s_in


ENTERING_STATE = {"p2p": p2p_entering_state, "all_gather": all_gather_entering_state}


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
    s_ext, m = summary_from(prep)
    s_in = ENTERING_STATE[mode](cp, s_ext, m)
    o, _ = outputs_from(prep, s_in)
    return finish(xp, w, dims, o, z)
