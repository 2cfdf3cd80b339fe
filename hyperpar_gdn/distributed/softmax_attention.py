"""Context parallelism for causal softmax attention, the algorithm: all-gather K and V, keep Q local.

Rank r of the CP axis holds tokens ``[r*T/cp, (r+1)*T/cp)``. It projects its queries, keys and
values with RoPE at those global positions, all-gathers the keys and values of the whole
sequence (differentiable: the gradient is reduce-scattered back to each shard's owner) and runs
causal attention of its queries over keys ``0 .. (r+1)*T/cp - 1`` (later shards are invisible to
it, so they are dropped before the matmuls), described by their global positions
(:func:`hyperpar_gdn.ops.attention.softmax.attention`: blocks or kernel calls that no query sees are
skipped, no ``[T/cp, T]`` mask is built). The result equals the single-device layer's rows.
Shards may differ in length (they are padded to the longest for the all-gather); padding and
packed documents mask the keys (:class:`~hyperpar_gdn.distributed.sequence.GlobalSequence`).

The algorithm is written once (:func:`attention_forward`); per layer class a small adapter says
how the layer projects its shard and finishes the output (``project`` and ``finish``): ours in
:mod:`.softmax_attention_style`, transformers' in
:mod:`hyperpar_gdn.integrations.transformers.attention`.

Traffic per rank and forward: ``2 * B * Hkv * T/cp * D * (cp-1)`` elements (as much again in the
backward). With contiguous shards the work is unbalanced (the last rank attends over the whole
sequence). In the head_tail layout (:mod:`.layout`) rank r holds pieces r and 2cp-1-r of 2*cp:
it gathers all keys, and each of its fragments attends its queries over the keys before the
fragment's end, so every rank does the same work (pieces r and 2cp-1-r see r+1 and 2cp-r pieces
of keys: 2cp+1 in all).
"""

from __future__ import annotations

from typing import Any

from hyperpar_gdn.distributed.mesh import DeviceMesh
from hyperpar_gdn.distributed.sequence import GlobalSequence, check_context, exchange_lengths, gather_pieces
from hyperpar_gdn.ops.attention.softmax import attention
from hyperpar_gdn.ops.attention.visibility import Tokens
from hyperpar_gdn.ops.prefill_states import PrefillStates
from hyperpar_gdn.platform import Tensor

__all__ = ["attention_forward", "call_sequence", "shard_error"]


def attention_forward(
    adapter: Any,
    mesh: DeviceMesh,
    x_BTC: Tensor,
    seq: GlobalSequence,
    *,
    cos_sin: Any = None,
    prefill_states: PrefillStates | None = None,
) -> Tensor:
    """x ``[B, T_r, hidden]`` (this rank's piece of the sequence ``seq``) -> ``[B, T_r, hidden]``.

    ``prefill_states`` (an inference prefill's record): every rank gathers the keys and values of
    the whole sequence (the same one all-gather) and hands them over in global order."""
    states = prefill_states
    if seq.layout != "contiguous" and mesh.size() > 1:
        return _fragments_attention(adapter, mesh, x_BTC, seq, cos_sin=cos_sin, states=states)
    rank = mesh.get_local_rank()
    offset, visible = seq.offset(rank), seq.offset(rank + 1)  # keys [0, visible) can be seen
    xp = mesh.platform.ops
    q_BHTD, k_BHTD, v_BHTD, gate = adapter.project(x_BTC, position_offset=offset, cos_sin=cos_sin)
    if mesh.size() > 1:
        hkv = k_BHTD.shape[1]
        upto = rank + 1 if states is None else mesh.size()
        kv_BHTD = gather_pieces(mesh, xp.cat([k_BHTD, v_BHTD], 1), seq.lengths, 2, upto=upto)
        k_BHTD, v_BHTD = kv_BHTD[:, :hkv], kv_BHTD[:, hkv:]
    if states is not None:
        states.keep_kv(adapter.module, k_BHTD, v_BHTD)
        k_BHTD, v_BHTD = k_BHTD[:, :, :visible], v_BHTD[:, :, :visible]
    # Queries and keys by their global positions (and documents): the attention skips what
    # no query sees and never builds a [T_r, T] mask.
    docs = seq.doc_ids()  # host arrays, built once per forward: no copy to the host here
    docs = None if docs is None else docs[:visible]
    queries = Tokens.span(offset, visible, None if docs is None else docs[offset:])
    keys = Tokens.span(0, visible, docs)
    key_mask = None if seq.host_key_mask is None else seq.host_key_mask[:, :visible]
    o_BHTD = attention(xp, q_BHTD, k_BHTD, v_BHTD, queries=queries, keys=keys, key_mask=key_mask)
    b, h, t, d = o_BHTD.shape
    o_BTX = xp.permute(o_BHTD, (0, 2, 1, 3)).reshape(b, t, h * d)
    return adapter.finish(o_BTX, gate)


def _fragments_attention(
    adapter: Any,
    mesh: DeviceMesh,
    x_BTC: Tensor,
    seq: GlobalSequence,
    *,
    cos_sin: Any = None,
    states: PrefillStates | None = None,
) -> Tensor:
    """:func:`attention_forward` for a shard of several fragments (head_tail): all keys are
    gathered and put in global order; the rank's queries, at their global positions, attend over
    them in one call (each fragment sees the keys before its end; the rest is skipped)."""
    xp = mesh.platform.ops
    tokens = seq.token_layout()
    rank = mesh.get_local_rank()
    mine = tokens.mine(rank)
    if cos_sin is not None:  # transformers: RoPE from the cos/sin of the shard's global positions
        q_BHTD, k_BHTD, v_BHTD, gate = adapter.project(x_BTC, position_offset=0, cos_sin=cos_sin)
    else:  # ours: RoPE from each fragment's first position
        pieces = xp.split(x_BTC, [f.length for f in mine], 1)
        parts = [adapter.project(x, position_offset=f.start) for x, f in zip(pieces, mine, strict=True)]
        q_BHTD, k_BHTD, v_BHTD = (xp.cat([p[i] for p in parts], 2) for i in range(3))
        gate = xp.cat([p[3] for p in parts], 1)
    hkv = k_BHTD.shape[1]
    kv_BHTD = tokens.to_global(xp, gather_pieces(mesh, xp.cat([k_BHTD, v_BHTD], 1), seq.lengths, 2), 2)
    if states is not None:
        states.keep_kv(adapter.module, kv_BHTD[:, :hkv], kv_BHTD[:, hkv:])
    positions = tokens.positions(rank)
    docs = seq.doc_ids()
    queries = Tokens(positions, None if docs is None else docs[positions])
    keys = Tokens.span(0, tokens.seq_len, docs)
    o_BHTD = attention(
        xp, q_BHTD, kv_BHTD[:, :hkv], kv_BHTD[:, hkv:], queries=queries, keys=keys, key_mask=seq.host_key_mask
    )
    b, h, t, d = o_BHTD.shape
    return adapter.finish(xp.permute(o_BHTD, (0, 2, 1, 3)).reshape(b, t, h * d), gate)


def shard_error(x_BTC: Tensor, hidden_size: int) -> str | None:
    shape = tuple(x_BTC.shape)
    if len(shape) != 3 or shape[-1] != hidden_size:
        return f"the local shard must be [B, T/cp, hidden_size={hidden_size}]; got {shape}"
    return None


def call_sequence(
    mesh: DeviceMesh,
    layout: str,
    x_BTC: Tensor,
    hidden_size: int,
    *,
    cp_context: GlobalSequence | None = None,
    cu_seqlens: Any = None,
) -> GlobalSequence:
    """The whole sequence an attention layer's call sees: the model's per-forward context
    ``cp_context``, checked against this layer and this rank's shard, or, for a layer called on
    its own, one built from the call (the shard lengths exchanged, where every rank stops on any
    rank's bad input, and the documents of ``cu_seqlens``)."""
    if cp_context is None:
        error = shard_error(x_BTC, hidden_size)
        if error is None and cu_seqlens is not None and x_BTC.shape[0] != 1:
            error = f"packed documents (cu_seqlens) need batch size B=1; got B={x_BTC.shape[0]}"
        lengths = exchange_lengths(mesh, None if error else x_BTC.shape[1], error)
        return GlobalSequence.build(lengths, rank=mesh.get_local_rank(), layout=layout, cu_seqlens=cu_seqlens)
    return check_context(
        cp_context,
        "an attention layer",
        layout=layout,
        rank=mesh.get_local_rank(),
        tokens=x_BTC.shape[1] if len(x_BTC.shape) > 1 else 0,
        given=() if cu_seqlens is None else ("cu_seqlens",),
        error=shard_error(x_BTC, hidden_size),
    )
