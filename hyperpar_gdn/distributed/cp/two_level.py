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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hyperpar_gdn.distributed.cp.common import CPGroup, LayerCall, ShardDocs, conv_with_halo
from hyperpar_gdn.distributed.cp.state_passing import EXCHANGES
from hyperpar_gdn.distributed.cp.ulysses import heads_in, heads_out, local_heads
from hyperpar_gdn.ops import prepare_chunks
from hyperpar_gdn.ops.gdn.onepass import shard_outputs
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
    doc_starts: np.ndarray | None = None,
) -> Tensor:
    """x ``[B, T_r, hidden]`` (this rank's shard; ``lengths``: every rank's, CP rank order) ->
    ``[B, T_r, hidden]``. ``doc_starts``: ``[T]`` bool, True where a packed document starts in
    the whole sequence (B = 1)."""
    inner, outer = levels.inner, levels.outer
    xp = inner.xp
    node = list(lengths[outer.rank * inner.size : (outer.rank + 1) * inner.size])
    start = sum(lengths[: outer.rank * inner.size])
    hin = heads_in(inner, call, x, attention_mask, node)
    mine = hin.shares[inner.rank]
    docs = (
        None
        if doc_starts is None
        else ShardDocs.of_segment(doc_starts, start, sum(node), call.dims.conv_kernel_size)
    )
    q, k, v, g, beta = local_heads(
        xp, call, mine, hin.full, lambda conv_in, weight: conv_with_halo(outer, conv_in, weight, docs)
    )
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
    exchange = EXCHANGES[state_mode](outer)
    o = xp.cast(shard_outputs(prep, exchange, widened=outer.rank > 0), prep.out_dtype)
    bsz = o.shape[0]
    return heads_out(inner, call, hin, o.reshape(bsz, sum(node), mine.v_count * call.dims.head_v_dim), node)


def two_level_length_error(
    mode: str, lengths: Sequence[int], inner_size: int, conv_kernel_size: int
) -> str | None:
    """Every rank needs a token (ulysses), every node's segment the conv halo W-1 (the state
    mode); the same answer on every rank (all know the lengths)."""
    if min(lengths) < 1:
        return f"mode={mode!r}: the shard of CP rank {list(lengths).index(min(lengths))} is empty; every shard needs a token"
    segments = [sum(lengths[o : o + inner_size]) for o in range(0, len(lengths), inner_size)]
    halo = conv_kernel_size - 1
    short = [o for o, t in enumerate(segments) if t < halo]
    if short:
        return (
            f"mode={mode!r}: the segment of node {short[0]} (inner_size={inner_size} ranks) has "
            f"{segments[short[0]]} tokens, fewer than the conv halo W-1={halo}; use a longer sequence"
        )
    return None
