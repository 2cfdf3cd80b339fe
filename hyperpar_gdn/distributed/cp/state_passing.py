"""The p2p and all_gather modes: one local pass, an exchange for the entering state, the outputs.

Both run the same pipeline on the local shard; they differ only in how rank r obtains S_in:

- p2p: S_in arrives from rank r-1, rank r forwards M_r S_in + S_ext_r to rank r+1 (a chain in
  which only this affine step is sequential); backward sends dS_in back to rank r-1.
- all_gather: every rank gathers the packed summaries [S_ext | M] of all ranks and folds those of
  ranks < r; backward reduce-scatters the summaries' gradients to their owners.

One pass, no second output pass (docs/maths.md, :func:`hyperpar_gdn.ops.onepass.shard_outputs`):
before any communication each rank runs its chunks once on the widened state [S | M], which gives
its summary (S_ext, M) and the map Q_eff from the entering state to its outputs. The exchange (a
:class:`P2PExchange` or :class:`AllGatherExchange`, called from inside the shard's autograd step)
returns S_in, from which the true chunk states and the outputs follow. Rank 0's entering state is
zero, so it runs the plain (width V) pass: its final state is S_ext and it needs neither Q_eff nor
M (M_0 only ever multiplies rank 0's zero entering state).

Every rank's output depends on its exchange, so every rank joins the backward collectives. The
backward hands dS_in = Q_eff^T do to the exchange first, which sends it on at once (only the
affine step waits for the peer) and returns dS_out; the rest is the plain backward of the shard
entered by S_in.
Shapes: S ``[B, H, K, V]``, M ``[B, H, K, K]``, packed ``[B, H, K, V+K]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hyperpar_gdn.ops import prepare_chunks
from hyperpar_gdn.ops.layer import finish, gates, head_dims, mask_padding, project, split_heads
from hyperpar_gdn.ops.onepass import shard_outputs
from hyperpar_gdn.platform import Tensor

from .common import CPGroup, LayerCall, ShardDocs, conv_with_halo


def _t(xp, x: Tensor) -> Tensor:
    return xp.swapaxes(x, -1, -2)


@dataclass
class P2PExchange:
    """S_in from rank r-1, M S_in + S_ext on to rank r+1; backward dS_in + M^T dS_out back to r-1."""

    cp: CPGroup
    saved: tuple[Tensor, ...] = field(default=(), repr=False)

    def forward(self, s_ext: Tensor, m: Tensor | None) -> Tensor:
        cp, xp = self.cp, self.cp.xp
        if cp.rank == 0:
            s_in, s_out = xp.zeros(s_ext.shape, like=s_ext), s_ext
        else:
            s_in = cp.comm.recv(s_ext, cp.rank - 1, cp.group)
            s_out = xp.matmul(m, s_in) + s_ext
        if cp.rank < cp.size - 1:
            cp.comm.send(s_out, cp.rank + 1, cp.group)
        self.saved = (s_in, m)
        return s_in

    def backward(self, ds_in: Tensor | None) -> Tensor:
        cp, xp = self.cp, self.cp.xp
        s_in, m = self.saved
        if cp.rank < cp.size - 1:
            ds_out = cp.comm.recv(s_in, cp.rank + 1, cp.group)
        else:
            ds_out = xp.zeros(s_in.shape, like=s_in)
        if cp.rank > 0:
            cp.comm.send(ds_in + xp.matmul(_t(xp, m), ds_out), cp.rank - 1, cp.group)
        return ds_out


@dataclass
class AllGatherExchange:
    """Every rank gathers the packed summaries [S_ext | M] of all ranks and folds those of ranks < r;
    backward reverses the fold and reduce-scatters the summaries' gradients to their owners (rank 0
    sends M = 0: no rank uses M_0)."""

    cp: CPGroup
    saved: tuple[Tensor, ...] = field(default=(), repr=False)

    def forward(self, s_ext: Tensor, m: Tensor | None) -> Tensor:
        cp, xp = self.cp, self.cp.xp
        if m is None:
            b, h, dk, _ = s_ext.shape
            m = xp.zeros((b, h, dk, dk), like=s_ext)
        gathered = cp.comm.all_gather(xp.cat([s_ext, m], -1), cp.group)  # [cp, B, H, K, V+K]
        dv = s_ext.shape[-1]
        states = [xp.zeros(s_ext.shape, like=s_ext)]  # the fold: s_{j+1} = M_j s_j + S_ext_j
        for j in range(cp.rank):
            states.append(xp.matmul(gathered[j][..., dv:], states[-1]) + gathered[j][..., :dv])
        self.saved = (gathered, *states)
        return states[-1]

    def backward(self, ds_in: Tensor | None) -> Tensor:
        cp, xp = self.cp, self.cp.xp
        gathered, *states = self.saved
        dv = states[0].shape[-1]
        grads = [xp.zeros(gathered[0].shape, like=gathered) for _ in range(cp.size)]
        ds = ds_in
        for j in range(cp.rank - 1, -1, -1):
            grads[j] = xp.cat([ds, xp.matmul(ds, _t(xp, states[j]))], -1)
            ds = xp.matmul(_t(xp, gathered[j][..., dv:]), ds)
        received = cp.comm.all_to_all(xp.stack(grads, 0), [1] * cp.size, [1] * cp.size, cp.group)
        # The gradient of this rank's S_ext is that of the state leaving it (that of M, its
        # product with S_in, is taken by the shard's own backward).
        return xp.sum(received, 0)[..., :dv]


EXCHANGES = {"p2p": P2PExchange, "all_gather": AllGatherExchange}


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
    q, k, v = split_heads(xp, conv_with_halo(cp, mixed, w.conv, docs), **head_dims(dims))
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
    o = xp.cast(shard_outputs(prep, EXCHANGES[mode](cp), widened=cp.rank > 0), prep.out_dtype)
    return finish(xp, w, dims, o, z)
