"""The ulysses mode (head parallel): trade the sequence split for a head split and back.

After the local projections, one packed all-to-all turns "all heads, local tokens" into "1/cp of
the value heads, all tokens": rank j receives, from every rank, the conv channels of its heads
(:class:`HeadShare`) and the beta and decay logits of its value heads. The conv (with the matching
channel slice of its weight) and the gated delta rule then run on the whole sequence for those
heads; a second all-to-all returns the outputs to "all heads, local tokens".

Heads: rank j takes value heads [j*H/cp, (j+1)*H/cp) and the q/k heads they use (value head i
uses q/k head i // (H/Hk)), so only H must be divisible by cp (:func:`ulysses_head_error`). When
Hk is divisible by cp too, the q/k heads of the ranks are disjoint; otherwise a q/k head whose
value heads sit on several ranks goes to each of them (its gradients come back summed).

Token layouts (:mod:`hyperpar_gdn.distributed.layout`): the whole sequence the all-to-all
assembles is the ranks' shards in rank order; for a layout whose shards are several fragments
(head_tail) it is put in global order before the conv and the rule, and back before the return.

Tokens: ranks may hold different numbers of tokens; ``lengths`` (every rank's, exchanged by the
caller) sets the uneven all-to-all splits. Both all-to-alls move flat buffers: the part for rank
j is its ``[B, T_r, width_j]`` block, flattened.

Legend: B batch, T tokens (all ranks), T_r rank r's tokens, H value heads, Hk q/k heads, Dk/Dv
head dims, hv = H/cp value heads per rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from hyperpar_gdn.distributed.cp.common import CPGroup, LayerCall
from hyperpar_gdn.distributed.layout import TokenLayout
from hyperpar_gdn.ops.gdn.kernels import gdn_rule
from hyperpar_gdn.ops.gdn.layer import (
    LayerDims,
    conv_silu,
    finish,
    gates,
    head_dims,
    mask_padding,
    project,
    split_heads,
)
from hyperpar_gdn.ops.gdn.varlen import Documents
from hyperpar_gdn.planning.plan import head_split_error
from hyperpar_gdn.platform import Tensor, TensorOps


def ulysses_head_error(dims: LayerDims, cp: int, mode: str = "ulysses") -> str | None:
    """Why ``mode`` (one of :data:`~hyperpar_gdn.planning.plan.HEAD_MODES`) cannot split the
    heads of a layer with ``dims`` over ``cp`` ranks, or None when it can: num_v_heads must be
    divisible by cp (num_k_heads need not be)."""
    return head_split_error(dims.num_v_heads, dims.num_k_heads, cp, mode)


@dataclass(frozen=True)
class HeadShare:
    """The heads of rank j: value heads [v_start, v_start + v_count) and the q/k heads
    [k_start, k_start + k_count) that they use."""

    v_start: int
    v_count: int
    k_start: int
    k_count: int

    @classmethod
    def of(cls, dims: LayerDims, cp: int, j: int) -> HeadShare:
        hv, groups = dims.num_v_heads // cp, dims.num_v_heads // dims.num_k_heads
        k_start, k_last = (j * hv) // groups, ((j + 1) * hv - 1) // groups
        return cls(v_start=j * hv, v_count=hv, k_start=k_start, k_count=k_last - k_start + 1)

    def conv_channels(self, dims: LayerDims) -> np.ndarray:
        """Indices of this rank's q, k and v channels among the conv's C = 2 Hk Dk + H Dv."""
        kd, dk, dv = dims.key_dim, dims.head_k_dim, dims.head_v_dim
        qk = np.arange(self.k_start * dk, (self.k_start + self.k_count) * dk)
        v = np.arange(2 * kd + self.v_start * dv, 2 * kd + (self.v_start + self.v_count) * dv)
        return np.concatenate([qk, kd + qk, v])

    def conv_width(self, dims: LayerDims) -> int:
        return 2 * self.k_count * dims.head_k_dim + self.v_count * dims.head_v_dim

    def width(self, dims: LayerDims) -> int:
        """Channels per token sent to this rank: its conv channels, beta and decay logits."""
        return self.conv_width(dims) + 2 * self.v_count

    def k_index(self, dims: LayerDims) -> list[int]:
        """For each local value head, the local q/k head it uses."""
        groups = dims.num_v_heads // dims.num_k_heads
        return [(self.v_start + i) // groups - self.k_start for i in range(self.v_count)]


def _per_value_head(xp: TensorOps, qk: Tensor, index: list[int]) -> Tensor:
    """q or k ``[B, T, k_count, Dk]`` arranged for the chunk rule, which repeats each q/k head
    over consecutive value heads: as is when ``index`` is that pattern, else one head per value
    head ``[B, T, hv, Dk]``."""
    k_count = index[-1] + 1
    repeats = len(index) // k_count
    if len(index) % k_count == 0 and index == [i // repeats for i in range(len(index))]:
        return qk
    return xp.cat([qk[:, :, h : h + 1] for h in index], 2)


def _send_index(dims: LayerDims, shares: Sequence[HeadShare]) -> np.ndarray:
    """Channels of [mixed | b | a] ``[B, T_r, conv_dim + 2H]`` that go to each rank, rank after
    rank: its q, k and v conv channels, then its beta and decay logits."""
    h = dims.num_v_heads
    conv_dim = 2 * dims.key_dim + h * dims.head_v_dim
    index = []
    for s in shares:
        heads = np.arange(s.v_start, s.v_start + s.v_count)
        index += [s.conv_channels(dims), conv_dim + heads, conv_dim + h + heads]
    return np.concatenate(index)


def _send_buffer(
    xp: TensorOps, mixed: Tensor, b: Tensor, a: Tensor, dims: LayerDims, shares: Sequence[HeadShare]
) -> Tensor:
    """The first all-to-all's send buffer: for each rank j in turn, its channels ``[B, T_r,
    width_j]`` (q, k and v conv channels, beta and decay logits of its heads), flattened.

    When every rank has as many q/k heads, the heads are picked on the head axis (only where
    ranks share a q/k head) and one concatenation of ``[n, B, T_r, *]`` views writes the buffer;
    otherwise one gather of channels and a split. Views and split pieces rather than slices: the
    gradient of a slice is a zero-filled full-size tensor."""
    bsz, t = mixed.shape[0], mixed.shape[1]
    n = len(shares)
    counts = {s.k_count for s in shares}
    index = _send_index(dims, shares) if xp.prefers_written_backward or len(counts) > 1 else None
    if index is not None and len(counts) == 1 and len(np.unique(index)) == len(index):
        return _gathered_send_buffer(xp, (mixed, b, a), index, n)
    if len(counts) > 1:
        picked = xp.take(xp.cat([mixed, b, a], 2), index, 2)  # [B, T_r, sum w_j]
        return xp.cat([y.reshape(-1) for y in xp.split(picked, [s.width(dims) for s in shares], 2)], 0)
    kc = counts.pop()
    q, k, v = split_heads(xp, mixed, **head_dims(dims))
    k_heads = np.concatenate([np.arange(s.k_start, s.k_start + kc) for s in shares])
    if not np.array_equal(k_heads, np.arange(dims.num_k_heads)):  # ranks share q/k heads
        q, k = xp.take(q, k_heads, 2), xp.take(k, k_heads, 2)
    hv = dims.num_v_heads // n
    pieces = [
        q.reshape(bsz, t, n, kc * dims.head_k_dim),
        k.reshape(bsz, t, n, kc * dims.head_k_dim),
        v.reshape(bsz, t, n, hv * dims.head_v_dim),
        b.reshape(bsz, t, n, hv),
        a.reshape(bsz, t, n, hv),
    ]
    rank_major = [xp.swapaxes(xp.swapaxes(y, 1, 2), 0, 1) for y in pieces]  # [n, B, T_r, *] views
    return xp.cat(rank_major, 3).reshape(-1)


def _gathered_send_buffer(xp: TensorOps, parts: tuple[Tensor, ...], index: np.ndarray, n: int) -> Tensor:
    """:func:`_send_buffer` when every rank gets as many channels and none is sent twice, as one
    gather of channels and one row order, with a written backward (the inverse gathers, one per
    part, so that no gradient is a strided slice). parts ``[B, T_r, C_i]`` (mixed, b, a)."""
    bsz, t = parts[0].shape[0], parts[0].shape[1]
    width = len(index) // n
    inverse = np.argsort(index)
    bounds = np.cumsum([0, *(p.shape[2] for p in parts)])

    def forward(*parts: Tensor) -> tuple[tuple[Tensor], tuple[()]]:
        picked = xp.take(xp.cat(list(parts), 2), index, 2).reshape(bsz, t, n, width)
        return (xp.permute(picked, (2, 0, 1, 3)).reshape(-1),), ()

    def backward(saved: tuple[()], grad: Tensor) -> tuple[Tensor, ...]:
        per_token = xp.permute(grad.reshape(n, bsz, t, width), (1, 2, 0, 3)).reshape(bsz, t, n * width)
        return tuple(
            xp.take(per_token, inverse[lo:hi], 2) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)
        )

    (buffer,) = xp.custom_vjp(forward, backward, *parts)
    return buffer


def _from_rank_major(xp: TensorOps, flat: Tensor, bsz: int, t: int, n: int) -> Tensor:
    """The flat buffer of n equal ``[B, t, W]`` blocks, rank after rank -> ``[B, t, n*W]``."""
    return xp.permute(flat.reshape(n, bsz, t, -1), (1, 2, 0, 3)).reshape(bsz, t, -1)


def to_token_blocks(xp: TensorOps, x: Tensor, lengths: Sequence[int]) -> Tensor:
    """x ``[B, T, W]`` -> the flat buffer of its consecutive ``[B, lengths[i], W]`` blocks (no copy
    for B = 1)."""
    bsz, _, width = x.shape
    if bsz == 1:
        return x.reshape(-1)
    if len(set(lengths)) == 1:
        return xp.permute(x.reshape(bsz, len(lengths), lengths[0], width), (1, 0, 2, 3)).reshape(-1)
    return xp.cat([y.reshape(-1) for y in xp.split(x, lengths, 1)], 0)


def from_token_blocks(xp: TensorOps, flat: Tensor, bsz: int, lengths: Sequence[int], width: int) -> Tensor:
    """The flat buffer of consecutive ``[B, lengths[i], width]`` blocks -> ``[B, T, width]``."""
    if bsz == 1:
        return flat.reshape(1, sum(lengths), width)
    if len(set(lengths)) == 1:
        x = xp.permute(flat.reshape(len(lengths), bsz, lengths[0], width), (1, 0, 2, 3))
        return x.reshape(bsz, sum(lengths), width)
    sizes = [bsz * t * width for t in lengths]
    return xp.cat(
        [y.reshape(bsz, t, width) for y, t in zip(xp.split(flat, sizes, 0), lengths, strict=True)], 1
    )


@dataclass(frozen=True)
class HeadsIn:
    """What the first all-to-all leaves on rank r: ``full`` ``[B, T, width_r]`` (the group's
    tokens in rank order; its heads' conv channels, beta and decay logits), the output gate ``z``
    of its own tokens, and the head shares of the group."""

    full: Tensor
    z: Tensor
    shares: tuple[HeadShare, ...]
    t_local: int


def heads_in(
    cp: CPGroup, call: LayerCall, x: Tensor, attention_mask: Tensor | None, lengths: Sequence[int]
) -> HeadsIn:
    """Project this rank's tokens and trade them for 1/cp of the heads over the group's tokens."""
    xp, dims, n, r = cp.xp, call.dims, cp.size, cp.rank
    shares = tuple(HeadShare.of(dims, n, j) for j in range(n))
    x = mask_padding(xp, x, attention_mask)
    mixed, z, b, a = project(xp, call.weights, x)
    bsz, t_local = mixed.shape[0], lengths[r]
    widths = [s.width(dims) for s in shares]
    received = cp.comm.all_to_all(
        _send_buffer(xp, mixed, b, a, dims, shares),
        [bsz * t_local * w for w in widths],
        [bsz * t * widths[r] for t in lengths],
        cp.group,
    )
    return HeadsIn(from_token_blocks(xp, received, bsz, lengths, widths[r]), z, shares, t_local)


def local_heads(xp: TensorOps, call: LayerCall, mine: HeadShare, full: Tensor, conv: Callable) -> tuple:
    """q, k, v, g, beta of this rank's heads from ``full`` ``[B, T, width]`` (global order);
    ``conv(conv_in, weight)``: the causal conv + SiLU of its channels with their weight slice."""
    dims, w, hv = call.dims, call.weights, mine.v_count
    conv_in, b_mine, a_mine = xp.split(full, [mine.conv_width(dims), hv, hv], 2)
    mixed_local = conv(conv_in, xp.take(w.conv, mine.conv_channels(dims), 0))
    q, k, v = split_heads(
        xp,
        mixed_local,
        num_k_heads=mine.k_count,
        num_v_heads=hv,
        head_k_dim=dims.head_k_dim,
        head_v_dim=dims.head_v_dim,
    )
    index = mine.k_index(dims)
    heads = slice(mine.v_start, mine.v_start + hv)
    g, beta = gates(xp, b_mine, a_mine, w.a_log[heads], w.dt_bias[heads])
    return _per_value_head(xp, q, index), _per_value_head(xp, k, index), v, g, beta


def heads_out(cp: CPGroup, call: LayerCall, hin: HeadsIn, o: Tensor, lengths: Sequence[int]) -> Tensor:
    """This rank's heads' outputs ``[B, T, hv*Dv]`` (rank order) back to "all heads, own tokens",
    then the gated norm and the output projection: ``[B, T_r, hidden]``."""
    xp, dims, n = cp.xp, call.dims, cp.size
    bsz, width = o.shape[0], o.shape[-1]
    back = cp.comm.all_to_all(
        to_token_blocks(xp, o, lengths),
        [bsz * t * width for t in lengths],
        [bsz * hin.t_local * width] * n,
        cp.group,
    )
    o = _from_rank_major(xp, back, bsz, hin.t_local, n)  # [B, T_r, H*Dv], heads in order
    return finish(
        xp, call.weights, dims, o.reshape(bsz, hin.t_local, dims.num_v_heads, dims.head_v_dim), hin.z
    )


def heads_whole_sequence(
    xp: TensorOps,
    call: LayerCall,
    mine: HeadShare,
    full: Tensor,
    docs: Documents | None,
    *,
    final_state: bool,
) -> tuple[Tensor, Tensor | None]:
    """The conv and the rule of this rank's heads over the whole sequence: ``full`` ``[B, T,
    width]`` (global order; its conv channels, beta and decay logits) -> (o ``[B, T, hv, Dv]``,
    the final state ``[B or N, hv, Dk, Dv]`` when ``final_state``, else None). Packed documents
    (``docs``: the whole sequence's) restart the conv and the state at the global document starts."""
    q, k, v, g, beta = local_heads(
        xp, call, mine, full, lambda conv_in, weight: conv_silu(xp, conv_in, weight, doc_starts=docs)
    )
    # one call of the local kernel; a packed prefill gives every document's last state
    return gdn_rule(
        q,
        k,
        v,
        g,
        beta,
        kernel=call.kernel,
        chunk_size=call.chunk_size,
        doc_starts=docs,
        output_final_state=final_state,
    )


def gather_head_states(cp: CPGroup, dims: LayerDims, s_mine: Tensor) -> Tensor:
    """Every rank's final states of its heads ``[B or N, hv, Dk, Dv]`` -> all heads ``[B or N, H,
    Dk, Dv]`` on every rank (one all-gather; an inference prefill, no gradient)."""
    gathered = cp.comm.all_gather(s_mine, cp.group)  # [cp, B or N, hv, Dk, Dv], rank j's heads
    return cp.xp.permute(gathered, (1, 0, 2, 3, 4)).reshape(
        s_mine.shape[0], dims.num_v_heads, dims.head_k_dim, dims.head_v_dim
    )


def ulysses_forward(
    cp: CPGroup,
    call: LayerCall,
    x: Tensor,
    attention_mask: Tensor | None,
    lengths: Sequence[int],
    docs: Documents | None = None,
    layout: TokenLayout | None = None,
    *,
    final_state: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """x ``[B, T_r, hidden]`` (this rank's shard; ``lengths[j]`` = T_j on every rank) ->
    ``[B, T_r, hidden]``. Packed documents (``docs``): the conv and the rule run on the whole
    sequence, so they restart at the global document starts. ``layout`` (None: contiguous): the
    received shards are put in global order after the first all-to-all and back in rank order
    before the second (a split and a concatenation each way, nothing for contiguous).

    ``final_state``: also return the state after the sequence's last token ``[B, H, K, V]``
    (compute dtype) on every rank: each rank's heads ran the whole sequence; one all-gather puts
    them together (an inference prefill; no gradient). With packed documents (``docs``): the state
    after every document's last token ``[N, H, K, V]``."""
    xp, dims = cp.xp, call.dims
    hin = heads_in(cp, call, x, attention_mask, lengths)
    mine = hin.shares[cp.rank]
    full = hin.full if layout is None else layout.to_global(xp, hin.full, 1)
    o, s_mine = heads_whole_sequence(xp, call, mine, full, docs, final_state=final_state)
    # [B, T, hv*Dv]: the tokens of rank i go back to rank i; rank j's heads arrive from rank j
    bsz = o.shape[0]
    o = o.reshape(bsz, sum(lengths), mine.v_count * dims.head_v_dim)
    if layout is not None:
        o = layout.to_rank_order(xp, o, 1)
    y = heads_out(cp, call, hin, o, lengths)
    if not final_state:
        return y
    return y, gather_head_states(cp, dims, s_mine)
