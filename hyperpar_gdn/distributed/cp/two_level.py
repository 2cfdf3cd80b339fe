"""Two-level CP for a GDN layer: ulysses over an inner axis, a state mode over an outer axis.

The CP group of cp = outer x inner ranks holds contiguous shards in rank order; rank
r = o * inner + i (o: its node, i: its place in the node). The inner ranks of node o hold
consecutive shards, together the node's *segment* of the sequence.

1. Inside each node (the inner group, fast links) ulysses trades "all heads, own tokens" for
   "inner-th of the heads, the node's segment" (one packed all-to-all, :func:`.ulysses.heads_in`).
2. Across nodes (the outer group: the ranks with the same i, hence the same heads), the segments
   are shards of one sequence for those heads: the conv takes its halo from the previous node's
   rank i, and a state mode (p2p, all_gather or scan, :mod:`.state_passing`) gives each segment
   its entering state; one widened pass gives outputs and summary as in those modes.
3. Back inside the node, the second all-to-all returns the outputs to "all heads, own tokens".

Traffic per rank: ulysses' activations over the inner links only (its T is the segment), and the
state mode's few summaries over the outer links, for H/inner heads each.
Packed documents: the conv and the chunks of a segment restart at the global document starts;
the state mode's summaries cut the chain as in the one-level modes.

head_tail (rank r holds pieces r and 2cp-1-r of 2cp): node o's ranks hold the head pieces
o*k .. o*k+k-1 and the tail pieces 2cp-1-o*k .. 2cp-o*k-k, so after the all-to-all the node has
two segments of k pieces each, the head segment (outer piece o of 2 cp/k) and the tail segment
(outer piece 2 cp/k - 1 - o). Across nodes that is the head_tail layout again, over the outer
group with pieces k times longer: the segments run as two rows of one batch and the state mode
chains them in global order, as a one-level head_tail shard's fragments.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hyperpar_gdn.distributed.cp.common import CPGroup, LayerCall, conv_fragments, conv_with_halo
from hyperpar_gdn.distributed.cp.state_passing import EXCHANGES
from hyperpar_gdn.distributed.cp.ulysses import HeadsIn, heads_in, heads_out, local_heads
from hyperpar_gdn.distributed.layout import TokenLayout
from hyperpar_gdn.ops.gdn.kernels import shard_rule
from hyperpar_gdn.ops.gdn.varlen import Documents
from hyperpar_gdn.platform import Tensor


@dataclass(frozen=True)
class Levels:
    """This rank's inner (node) and outer (same place in every node) CP groups."""

    inner: CPGroup
    outer: CPGroup
    flat_group: object  # the whole CP group's


def make_levels(
    platform, cp: CPGroup, ranks: Sequence[int], inner_size: int, *, replicas: Sequence[Sequence[int]] = ()
) -> Levels:
    """Create the inner and outer groups of the CP group over global ``ranks``, and those of the
    other CP groups of the world (``replicas``: every CP group's ranks, this one included, the
    same list on every process; data parallelism beside CP), since process groups are made
    collectively: every rank of the world calls this with the same ``replicas``."""
    outer_size = len(ranks) // inner_size
    mine = None
    for members in replicas or [ranks]:
        inner_groups = [
            platform.new_group(list(members[o * inner_size : (o + 1) * inner_size]))
            for o in range(outer_size)
        ]
        outer_groups = [platform.new_group(list(members[i::inner_size])) for i in range(inner_size)]
        if list(members) == list(ranks):
            mine = inner_groups, outer_groups
    if mine is None:
        raise ValueError(
            f"the CP group's ranks {list(ranks)} are not among replicas={[list(r) for r in replicas]}"
        )
    inner_groups, outer_groups = mine
    o, i = divmod(cp.rank, inner_size)
    return Levels(
        inner=CPGroup(xp=cp.xp, comm=cp.comm, group=inner_groups[o], rank=i, size=inner_size),
        outer=CPGroup(xp=cp.xp, comm=cp.comm, group=outer_groups[i], rank=o, size=outer_size),
        flat_group=cp.group,
    )


def two_level_forward(
    state_mode: str,
    levels: Levels,
    call: LayerCall,
    x: Tensor,
    attention_mask: Tensor | None,
    lengths: Sequence[int],
    docs: Documents | None = None,
    *,
    layout: str = "contiguous",
) -> Tensor:
    """x ``[B, T_r, hidden]`` (this rank's shard; ``lengths``: every rank's, CP rank order) ->
    ``[B, T_r, hidden]``. ``docs``: packed documents (B = 1) of the spans of :func:`node_spans`,
    one row each with its conv halo. ``layout``: ``"contiguous"`` or ``"head_tail"`` (the shard
    is the rank's two pieces, concatenated)."""
    inner, outer = levels.inner, levels.outer
    xp = inner.xp
    node = list(lengths[outer.rank * inner.size : (outer.rank + 1) * inner.size])
    hin = heads_in(inner, call, x, attention_mask, node)
    if layout == "head_tail":
        return _head_tail(state_mode, levels, call, hin, node, docs)
    mine = hin.shares[inner.rank]
    q, k, v, g, beta = local_heads(
        xp, call, mine, hin.full, lambda conv_in, weight: conv_with_halo(outer, conv_in, weight, docs)
    )
    exchange = EXCHANGES[state_mode](outer)
    o = shard_rule(
        q,
        k,
        v,
        g,
        beta,
        exchange,
        kernel=call.kernel,
        chunk_size=call.chunk_size,
        widened=outer.rank > 0,
        doc_starts=docs,
    )
    bsz = o.shape[0]
    return heads_out(inner, call, hin, o.reshape(bsz, sum(node), mine.v_count * call.dims.head_v_dim), node)


def _head_tail(
    state_mode: str,
    levels: Levels,
    call: LayerCall,
    hin: HeadsIn,
    node: list[int],
    docs: Documents | None,
) -> Tensor:
    """The head_tail case of :func:`two_level_forward` after the first all-to-all: ``hin.full``
    ``[B, sum(node), width]`` holds the node's ranks' shards (head piece, tail piece each) in rank
    order; in node order they are the head segment then the tail segment."""
    inner, outer = levels.inner, levels.outer
    xp = inner.xp
    mine = hin.shares[inner.rank]
    in_node = TokenLayout.of("head_tail", node)  # the node's tokens as one head_tail sequence
    across = TokenLayout.of("head_tail", [sum(node)] * outer.size)  # the segments across nodes
    segments = across.mine(outer.rank)  # [head, tail]; one piece when there is one node
    sizes = [f.length for f in segments]

    def conv(conv_in: Tensor, weight: Tensor) -> Tensor:
        return xp.cat(conv_fragments(outer, across, xp.split(conv_in, sizes, 1), weight, docs), 1)

    q, k, v, g, beta = local_heads(xp, call, mine, in_node.to_global(xp, hin.full, 1), conv)

    def rows(y: Tensor) -> Tensor:  # [B, 2S, ...] -> [2B, S, ...], segment-major
        return xp.cat(xp.split(y, sizes, 1), 0)

    q, k, v, g, beta = (rows(y) for y in (q, k, v, g, beta))
    exchange = EXCHANGES[state_mode](outer, across)
    o = shard_rule(  # [2B, S, hv, Dv]
        q,
        k,
        v,
        g,
        beta,
        exchange,
        kernel=call.kernel,
        chunk_size=call.chunk_size,
        widened=True,
        doc_starts=docs,  # a row per segment
    )
    bsz = o.shape[0] // len(segments)
    o = xp.cat(xp.split(o, [bsz] * len(segments), 0), 1).reshape(
        bsz, sum(node), mine.v_count * call.dims.head_v_dim
    )
    return heads_out(inner, call, hin, in_node.to_rank_order(xp, o, 1), node)


def node_spans(
    lengths: Sequence[int], inner_size: int, rank: int, *, layout: str = "contiguous"
) -> list[tuple[int, int]]:
    """The tokens ``(start, length)`` (global order) on which the node of CP rank ``rank`` runs the
    state mode: its ranks' shards together (contiguous), or its head and tail segments
    (head_tail; one segment when there is one node)."""
    o = rank // inner_size
    node = sum(lengths[o * inner_size : (o + 1) * inner_size])
    if layout == "head_tail":
        across = TokenLayout.of("head_tail", [node] * (len(lengths) // inner_size))
        return [(f.start, f.length) for f in across.mine(o)]
    return [(sum(lengths[: o * inner_size]), node)]


def two_level_length_error(
    mode: str, lengths: Sequence[int], inner_size: int, conv_kernel_size: int, *, layout: str = "contiguous"
) -> str | None:
    """Every rank needs a token (ulysses), every node's segment the conv halo W-1 (the state
    mode; head_tail: each of a node's two segments); the same answer on every rank (all know the
    lengths)."""
    if min(lengths) < 1:
        return f"mode={mode!r}: the shard of CP rank {list(lengths).index(min(lengths))} is empty; every shard needs a token"
    pieces = 2 if layout == "head_tail" else 1
    segments = [sum(lengths[o : o + inner_size]) // pieces for o in range(0, len(lengths), inner_size)]
    halo = conv_kernel_size - 1
    short = [o for o, t in enumerate(segments) if t < halo]
    if short:
        return (
            f"mode={mode!r}: the segment of node {short[0]} (inner_size={inner_size} ranks) has "
            f"{segments[short[0]]} tokens, fewer than the conv halo W-1={halo}; use a longer sequence"
        )
    return None
