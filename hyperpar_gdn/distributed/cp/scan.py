"""The scan mode: each fragment's entering state by an exclusive prefix scan of affine maps in
ceil(log2 n) rounds of point-to-point exchange (n fragments: cp, or 2 cp for head_tail).

A fragment's summary is an affine map of the state entering it, S_out = A S_in + B with
A = M ``[B, H, K, K]`` and B = S_ext ``[B, H, K, V]`` (compute dtype: fp32 for bf16 or fp16
inputs). Maps compose associatively, (A2, B2) o (A1, B1) = (A2 A1, A2 B1 + B2), so the state
entering fragment i, the composition of fragments 0..i-1 applied to zero, is an exclusive scan.

Hillis-Steele, exclusive in the same number of rounds: fragment i keeps P_i, the composition of
the window of fragments [i - 2^j + 1, i] after round j, and E_i, the same window without i
itself. In round j (d = 2^j) fragment i sends P_i to fragment i + d and receives P_{i-d}; then
P_i <- P_i o P_{i-d} and E_i <- E_i o P_{i-d}. After ceil(log2 n) rounds E_i covers 0..i-1.
Why not a work-efficient (Blelloch) scan: it needs 2 log2 n rounds (an up-sweep and a down-sweep)
and saves only K^3 products, which are negligible next to a shard's chunk work when T/cp >> K;
with few tokens per rank the latency of a round is what counts, and Hillis-Steele has the fewest.

A window that reaches fragment 0 is *anchored*: no state enters fragment 0, so the window's A
never matters and is neither sent nor multiplied (A is ``None``); fragment i's P is anchored
from round j on iff i < 2^j, which both ends of a message know without asking. So the first
fragment's owner sends B only, and so does every fragment once its window has reached the start.

Backward: the gradient leaving fragment i (what the shard's own backward needs) obeys
lambda_i = A_{i+1}^T lambda_{i+1} + g_{i+1} with g_j = dS_in of fragment j from its outputs and
lambda_{n-1} = 0: the same exclusive scan over the adjoint maps (A_j^T, g_j) in the opposite
order. A's own gradient is the shard's (see :mod:`hyperpar_gdn.ops.gdn.onepass`), as in p2p.

A rank posts all its messages of a round at once (one :meth:`~hyperpar_gdn.platform.Collectives.exchange`):
on backends whose sends wait for the matching receive (NCCL, HCCL) no order of the ranks can then
deadlock, and a round costs one latency: ceil(log2 n) rounds in sequence. Two messages between
the same ranks in one round (head_tail) are sent and received in fragment order, so they match.

Packed documents: a document starting inside a fragment makes its A zero past the start (the
shard's widened pass does that), which cuts the chain; nothing else changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hyperpar_gdn.distributed.cp.chain import Chain, split_fragments
from hyperpar_gdn.distributed.cp.common import CPGroup
from hyperpar_gdn.distributed.layout import TokenLayout
from hyperpar_gdn.platform import Tensor

# An affine map (A, B): A None when anchored (a window containing the first element: A unused).
Affine = tuple[Tensor | None, Tensor]


def _compose(xp, later: Affine | None, earlier: Affine) -> Affine:
    """``later o earlier``; ``later`` None is the identity."""
    if later is None:
        return earlier
    a2, b2 = later
    a1, b1 = earlier
    if a2 is None:  # an anchored map ignores what enters it
        return later
    return (None if a1 is None else xp.matmul(a2, a1)), xp.matmul(a2, b1) + b2


def exclusive_scan(cp: CPGroup, owners: tuple[int, ...], maps: dict[int, Affine]) -> dict[int, Tensor]:
    """Elements 0..n-1 in order, element i held by rank ``owners[i]``; ``maps``: this rank's
    elements' maps (element 0's A is ignored). Returns, for each of this rank's elements i, the
    composition of elements 0..i-1 applied to zero (zeros for element 0)."""
    xp, n = cp.xp, len(owners)
    like = next(iter(maps.values()))[1]
    inclusive = {i: (None, b) if i == 0 else (a, b) for i, (a, b) in maps.items()}
    exclusive: dict[int, Affine | None] = dict.fromkeys(maps)
    d = 1
    while d < n:
        received: dict[int, Affine] = {}
        sends, recvs, into = [], [], []  # this rank's messages of the round, posted as one batch
        for src in range(n - d):
            dst = src + d
            sender, receiver = owners[src], owners[dst]
            if sender == receiver == cp.rank:
                received[dst] = inclusive[src]
            elif sender == cp.rank:
                a, b = inclusive[src]
                sends.append((b if a is None else xp.cat([b, a], -1), receiver))
            elif receiver == cp.rank:
                dv, dk = like.shape[-1], like.shape[-2]
                shape = (*like.shape[:-1], dv if src < d else dv + dk)  # src < d: anchored, B only
                recvs.append((xp.zeros(shape, like=like), sender))
                into.append((src, dst))
        for (src, dst), got in zip(into, cp.comm.exchange(sends, recvs, cp.group), strict=True):
            dv = like.shape[-1]
            received[dst] = (None, got) if src < d else (got[..., dv:], got[..., :dv])
        for i, p in received.items():
            exclusive[i] = _compose(xp, exclusive[i], p)
            if i + 2 * d < n:  # P_i is sent again next round
                inclusive[i] = _compose(xp, inclusive[i], p)
        d *= 2
    return {i: xp.zeros(like.shape, like=like) if e is None else e[1] for i, e in exclusive.items()}


@dataclass
class ScanExchange:
    """The :class:`~hyperpar_gdn.ops.gdn.onepass.StateExchange` of ``mode="scan"``: S_in by the
    exclusive scan of the fragments' maps (M, S_ext) in global order; backward, dS_out by the
    scan of the adjoint maps (M^T, dS_in) in reverse order. Summaries are ``[n*B, ...]``: this
    rank's n fragments, slot-major. ``keep_final``: keep what :meth:`final_state` needs."""

    cp: CPGroup
    layout: TokenLayout | None = None
    keep_final: bool = False
    saved: tuple = field(default=(), repr=False)

    def forward(self, s_ext: Tensor, m: Tensor | None) -> Tensor:
        xp = self.cp.xp
        chain = Chain.of(self.cp, self.layout)
        n = len(chain.mine)
        s_exts = split_fragments(xp, s_ext, n)
        ms = [None] * n if m is None else split_fragments(xp, m, n)
        owners = tuple(rank for rank, _ in chain.order)
        maps = {i: (ms[slot], s_exts[slot]) for slot, i in enumerate(chain.mine)}
        entering = exclusive_scan(self.cp, owners, maps)
        s_ins = [entering[i] for i in chain.mine]
        self.saved = (chain, ms, s_exts if self.keep_final else None, s_ins)
        return s_ins[0] if n == 1 else xp.cat(s_ins, 0)

    def final_state(self) -> Tensor:
        """The state leaving the sequence's last fragment, on every rank: its owner's
        M S_in + S_ext, summed with zeros from the others."""
        cp, xp = self.cp, self.cp.xp
        chain, ms, s_exts, s_ins = self.saved
        owner, slot = chain.order[-1]
        if cp.rank != owner:
            mine = xp.zeros(s_ins[0].shape, like=s_ins[0])
        elif ms[slot] is None:  # the only fragment: nothing enters it
            mine = s_exts[slot]
        else:
            mine = xp.matmul(ms[slot], s_ins[slot]) + s_exts[slot]
        return cp.comm.all_reduce_sum(mine, cp.group)

    def entering_state(self) -> Tensor:
        """The state entering this rank's (first) fragment ``[B, H, K, V]``."""
        return self.saved[3][0]

    def backward(self, ds_in: Tensor | None) -> Tensor:
        xp = self.cp.xp
        chain, ms, _, s_ins = self.saved
        n, last = len(chain.mine), len(chain.order) - 1
        ds_ins = (
            [xp.zeros(s.shape, like=s) for s in s_ins] if ds_in is None else split_fragments(xp, ds_in, n)
        )
        owners = tuple(rank for rank, _ in reversed(chain.order))
        # element last - i is fragment i; a fragment without M (the first) is never composed
        maps = {
            last - i: (None if ms[slot] is None else xp.swapaxes(ms[slot], -1, -2), ds_ins[slot])
            for slot, i in enumerate(chain.mine)
        }
        leaving = exclusive_scan(self.cp, owners, maps)
        ds_outs = [leaving[last - i] for i in chain.mine]
        return ds_outs[0] if n == 1 else xp.cat(ds_outs, 0)
