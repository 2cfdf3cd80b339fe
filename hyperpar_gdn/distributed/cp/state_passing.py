"""The state modes (p2p, all_gather, scan): one local pass, an exchange for the entering state, the outputs.

All run the same pipeline on the local shard; they differ only in how rank r obtains S_in:

- p2p: S_in arrives from rank r-1, rank r forwards M_r S_in + S_ext_r to rank r+1 (a chain in
  which only this affine step is sequential); backward sends dS_in back to rank r-1.
- all_gather: every rank gathers the packed summaries [S_ext | M] of all ranks and folds those of
  ranks < r; backward reduce-scatters the summaries' gradients to their owners.
- scan: an exclusive prefix scan of the summaries in ceil(log2 n) rounds (:mod:`.scan`).

One pass, no second output pass (docs/maths.md, :func:`hyperpar_gdn.ops.gdn.onepass.shard_outputs`):
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

from hyperpar_gdn.distributed.cp.chain import Chain, split_fragments
from hyperpar_gdn.distributed.cp.common import CPGroup, LayerCall, conv_fragments, conv_with_halo
from hyperpar_gdn.distributed.cp.packed_states import ShardPieces, doc_final_states
from hyperpar_gdn.distributed.cp.scan import ScanExchange
from hyperpar_gdn.distributed.layout import TokenLayout
from hyperpar_gdn.ops.gdn.kernels import shard_rule
from hyperpar_gdn.ops.gdn.layer import finish, gates, head_dims, mask_padding, project, split_heads
from hyperpar_gdn.ops.gdn.varlen import Documents
from hyperpar_gdn.platform import Tensor


def _t(xp, x: Tensor) -> Tensor:
    return xp.swapaxes(x, -1, -2)


@dataclass
class P2PExchange:
    """Along the chain of fragments in global order: a fragment's S_in comes from the previous
    fragment's owner (rank r-1 for contiguous shards), M S_in + S_ext goes on to the next one's;
    backward sends dS_in + M^T dS_out back along the chain. A link between two fragments of the
    same rank stays local. Summaries are ``[n*B, ...]``: this rank's n fragments, slot-major.
    ``keep_final``: keep the states leaving this rank's fragments for :meth:`final_state`."""

    cp: CPGroup
    layout: TokenLayout | None = None
    saved: tuple = field(default=(), repr=False)
    keep_final: bool = False
    s_outs: tuple[Tensor, ...] = field(default=(), repr=False)

    def forward(self, s_ext: Tensor, m: Tensor | None) -> Tensor:
        cp, xp = self.cp, self.cp.xp
        chain = Chain.of(cp, self.layout)
        n = len(chain.mine)
        s_exts, ms = split_fragments(xp, s_ext, n), None if m is None else split_fragments(xp, m, n)
        s_ins: list[Tensor] = []
        s_outs: list[Tensor] = []
        for slot, i in enumerate(chain.mine):
            prev, nxt = chain.previous(i), chain.next(i)
            if prev is None:
                s_in, s_out = xp.zeros(s_exts[slot].shape, like=s_ext), s_exts[slot]
            else:
                s_in = (
                    s_outs[prev[1]]
                    if prev[0] == cp.rank
                    else cp.comm.exchange([], [(s_exts[slot], prev[0])], cp.group)[0]
                )
                s_out = xp.matmul(ms[slot], s_in) + s_exts[slot]
            if nxt is not None and nxt[0] != cp.rank:
                cp.comm.exchange([(s_out, nxt[0])], [], cp.group)
            s_ins.append(s_in)
            s_outs.append(s_out)
        self.saved = (chain, s_ins, ms)
        if self.keep_final:
            self.s_outs = tuple(s_outs)
        return s_ins[0] if n == 1 else xp.cat(s_ins, 0)

    def final_state(self) -> Tensor:
        """The state leaving the sequence's last fragment (the whole sequence's), on every rank:
        its owner's ``s_out``, summed with zeros from the others."""
        cp, xp = self.cp, self.cp.xp
        owner, slot = Chain.of(cp, self.layout).order[-1]
        like = self.s_outs[0]
        mine = self.s_outs[slot] if cp.rank == owner else xp.zeros(like.shape, like=like)
        return cp.comm.all_reduce_sum(mine, cp.group)

    def entering_state(self) -> Tensor:
        """The state entering this rank's (first) fragment ``[B, H, K, V]``."""
        return self.saved[1][0]

    def backward(self, ds_in: Tensor | None) -> Tensor:
        cp, xp = self.cp, self.cp.xp
        chain, s_ins, ms = self.saved
        n = len(chain.mine)
        ds_ins = None if ds_in is None else split_fragments(xp, ds_in, n)
        ds_outs: list[Tensor | None] = [None] * n
        to_previous: dict[int, Tensor] = {}  # dS_in + M^T dS_out of a slot whose predecessor is local
        for slot, i in reversed(list(enumerate(chain.mine))):
            prev, nxt = chain.previous(i), chain.next(i)
            if nxt is None:
                ds_out = xp.zeros(s_ins[slot].shape, like=s_ins[slot])
            elif nxt[0] == cp.rank:
                ds_out = to_previous[nxt[1]]
            else:
                ds_out = cp.comm.exchange([], [(s_ins[slot], nxt[0])], cp.group)[0]
            ds_outs[slot] = ds_out
            if prev is not None:
                grad = ds_ins[slot] + xp.matmul(_t(xp, ms[slot]), ds_out)
                if prev[0] == cp.rank:
                    to_previous[slot] = grad
                else:
                    cp.comm.exchange([(grad, prev[0])], [], cp.group)
        return ds_outs[0] if n == 1 else xp.cat(ds_outs, 0)


@dataclass
class AllGatherExchange:
    """Every rank gathers the packed summaries [S_ext | M] of all fragments and folds, in global
    order, those before each of its own; backward reverses the fold and reduce-scatters the
    summaries' gradients to their owners (a fragment that no state enters sends M = 0).
    Summaries are ``[n*B, ...]``: this rank's n fragments, slot-major. ``keep_final``: keep the
    gathered summaries for :meth:`final_state`."""

    cp: CPGroup
    layout: TokenLayout | None = None
    saved: tuple = field(default=(), repr=False)
    keep_final: bool = False
    gathered: Tensor | None = field(default=None, repr=False)

    def forward(self, s_ext: Tensor, m: Tensor | None) -> Tensor:
        cp, xp = self.cp, self.cp.xp
        chain = Chain.of(cp, self.layout)
        n = len(chain.mine)
        if m is None:
            b, h, dk, _ = s_ext.shape
            m = xp.zeros((b, h, dk, dk), like=s_ext)
        gathered = cp.comm.all_gather(xp.cat([s_ext, m], -1), cp.group)  # [cp, n*B, H, K, V+K]
        dv, rows = s_ext.shape[-1], s_ext.shape[0] // n
        states = [xp.zeros((rows, *s_ext.shape[1:]), like=s_ext)]  # s_{i+1} = M_i s_i + S_ext_i
        summaries = []
        for i in range(max(chain.mine)):
            owner, slot = chain.order[i]
            packed = gathered[owner] if n == 1 else gathered[owner][slot * rows : (slot + 1) * rows]
            summaries.append(packed)
            states.append(xp.matmul(packed[..., dv:], states[-1]) + packed[..., :dv])
        self.saved = (chain, gathered.shape, summaries, states)
        if self.keep_final:
            self.gathered = gathered
        s_ins = [states[i] for i in chain.mine]
        return s_ins[0] if n == 1 else xp.cat(s_ins, 0)

    def final_state(self) -> Tensor:
        """The state leaving the sequence's last fragment (the whole sequence's), on every rank
        without communication: the fold of the gathered summaries carried on to the end."""
        xp = self.cp.xp
        chain, _, _, states = self.saved
        gathered = self.gathered
        n = len(chain.mine)
        dv, rows = states[0].shape[-1], states[0].shape[0]
        s = states[-1]
        for i in range(len(states) - 1, len(chain.order)):
            owner, slot = chain.order[i]
            packed = gathered[owner] if n == 1 else gathered[owner][slot * rows : (slot + 1) * rows]
            s = xp.matmul(packed[..., dv:], s) + packed[..., :dv]
        return s

    def entering_state(self) -> Tensor:
        """The state entering this rank's (first) fragment ``[B, H, K, V]``."""
        chain, _, _, states = self.saved
        return states[chain.mine[0]]

    def backward(self, ds_in: Tensor | None) -> Tensor:
        cp, xp = self.cp, self.cp.xp
        chain, shape, summaries, states = self.saved
        n = len(chain.mine)
        dv = states[0].shape[-1]
        ds_ins = {} if ds_in is None else dict(zip(chain.mine, split_fragments(xp, ds_in, n), strict=True))
        rows = shape[1] // n
        grads = {}
        ds = None
        for i in range(max(chain.mine), 0, -1):
            if i in ds_ins:
                ds = ds_ins[i] if ds is None else ds + ds_ins[i]
            grads[chain.order[i - 1]] = xp.cat([ds, xp.matmul(ds, _t(xp, states[i - 1]))], -1)
            ds = xp.matmul(_t(xp, summaries[i - 1][..., dv:]), ds)
        zeros = xp.zeros((rows, *shape[2:]), like=states[0])
        send = [
            xp.cat([grads.get((owner, slot), zeros) for slot in range(n)], 0)
            if n > 1
            else grads.get((owner, 0), zeros)
            for owner in range(cp.size)
        ]
        received = cp.comm.all_to_all(xp.stack(send, 0), [1] * cp.size, [1] * cp.size, cp.group)
        # The gradient of this rank's S_ext is that of the state leaving it (that of M, its
        # product with S_in, is taken by the shard's own backward).
        return xp.sum(received, 0)[..., :dv]


EXCHANGES = {"p2p": P2PExchange, "all_gather": AllGatherExchange, "scan": ScanExchange}


def state_passing_forward(
    mode: str,
    cp: CPGroup,
    call: LayerCall,
    x: Tensor,
    attention_mask: Tensor | None,
    docs: Documents | None = None,
    layout: TokenLayout | None = None,
    *,
    final_state: bool = False,
    pieces: ShardPieces | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """x ``[B, T_r, hidden]`` (this rank's shard) -> ``[B, T_r, hidden]``.

    ``layout`` None or contiguous: the shard is one piece of the sequence. Otherwise the shard is
    several fragments (:mod:`hyperpar_gdn.distributed.layout`, all of one length), which run as
    rows of one batch ``[n*B, P, ...]``: one widened pass, one exchange along the chain of
    fragments in global order. ``docs``: packed documents, one row (with its conv halo) per
    fragment, or one for a contiguous shard
    (:meth:`~hyperpar_gdn.distributed.sequence.GlobalSequence.shard_docs`).

    Packed documents: the shard's summary is exact across them (M = 0 once a document starts in
    the shard), so the exchange is unchanged; the conv and the local chunks restart at every
    start.

    ``final_state``: also return the state after the whole sequence's last token (that of the
    last fragment in global order) ``[B, H, K, V]`` (compute dtype) on every rank, from the summaries (an inference
    prefill; no gradient). With ``pieces`` (packed prompts, contiguous shards): the state after
    every prompt's last token ``[N, H, K, V]`` instead
    (:func:`~hyperpar_gdn.distributed.cp.packed_states.doc_final_states`)."""
    if layout is not None and not layout.is_contiguous:
        return _fragments_forward(mode, cp, call, x, attention_mask, docs, layout, final_state)
    xp, w, dims = cp.xp, call.weights, call.dims
    x = mask_padding(xp, x, attention_mask)
    mixed, z, b, a = project(xp, w, x)
    q, k, v = split_heads(xp, conv_with_halo(cp, mixed, w.conv, docs), **head_dims(dims))
    g, beta = gates(xp, b, a, w.a_log, w.dt_bias)
    exchange = EXCHANGES[mode](cp, keep_final=final_state)
    o = shard_rule(
        q,
        k,
        v,
        g,
        beta,
        exchange,
        kernel=call.kernel,
        chunk_size=call.chunk_size,
        widened=cp.rank > 0,
        doc_starts=docs,
    )
    y = finish(xp, w, dims, o, z)
    if not final_state:
        return y
    if pieces is None:
        return y, exchange.final_state()
    s_in = exchange.entering_state()
    return y, doc_final_states(
        cp, pieces, q, k, v, g, beta, s_in, chunk_size=call.chunk_size, kernel=call.kernel
    )


def _fragments_forward(
    mode: str,
    cp: CPGroup,
    call: LayerCall,
    x: Tensor,
    attention_mask: Tensor | None,
    docs: Documents | None,
    layout: TokenLayout,
    final_state: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """The shard's n fragments as n rows of one batch; every fragment is widened (the first
    fragment of the sequence gets a zero S_in from the exchange). ``final_state``: as in
    :func:`state_passing_forward`."""
    xp, w, dims = cp.xp, call.weights, call.dims
    mine = layout.mine(cp.rank)
    n, lengths = len(mine), [f.length for f in mine]
    x = mask_padding(xp, x, attention_mask)
    mixed, z, b, a = project(xp, w, x)
    pieces = xp.split(mixed, lengths, 1)
    convs = conv_fragments(cp, layout, pieces, w.conv, docs)

    def rows(y: Tensor) -> Tensor:  # [B, T_r, *] -> [n*B, P, *], slot-major
        return xp.cat(xp.split(y, lengths, 1), 0)

    q, k, v = split_heads(xp, xp.cat(convs, 0), **head_dims(dims))
    g, beta = gates(xp, rows(b), rows(a), w.a_log, w.dt_bias)
    exchange = EXCHANGES[mode](cp, layout, keep_final=final_state)
    o = shard_rule(
        q,
        k,
        v,
        g,
        beta,
        exchange,
        kernel=call.kernel,
        chunk_size=call.chunk_size,
        widened=True,
        doc_starts=docs,  # a row per fragment (B = 1)
    )
    y = finish(xp, w, dims, xp.cat(xp.split(o, [o.shape[0] // n] * n, 0), 1), z)
    return (y, exchange.final_state()) if final_state else y
