"""Context parallelism for causal softmax attention: all-gather K and V, keep Q local.

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
how the layer projects its shard and finishes the output:

- :class:`OwnAttention`: ``hyperpar_gdn``'s ``CausalSelfAttention`` (torch and MindSpore), which
  computes RoPE itself from the shard's position offset;
- ``TransformersAttention`` (:mod:`hyperpar_gdn.integrations.transformers.attention`): transformers' ``Qwen3_5Attention`` / ``Qwen3_5MoeAttention``,
  which take the cos/sin that the model computed from the shard's global ``position_ids``.

Traffic per rank and forward: ``2 * B * Hkv * T/cp * D * (cp-1)`` elements (as much again in the
backward). With contiguous shards the work is unbalanced (the last rank attends over the whole
sequence). In the head_tail layout (:mod:`.layout`) rank r holds pieces r and 2cp-1-r of 2*cp:
it gathers all keys, and each of its fragments attends its queries over the keys before the
fragment's end, so every rank does the same work (pieces r and 2cp-1-r see r+1 and 2cp-r pieces
of keys: 2cp+1 in all).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hyperpar_gdn.distributed.layout import check_layout
from hyperpar_gdn.distributed.mesh import DeviceMesh, as_cp_mesh
from hyperpar_gdn.distributed.parallel_style import ParallelStyle, from_transformers
from hyperpar_gdn.distributed.sequence import GlobalSequence, exchange_lengths, gather_pieces
from hyperpar_gdn.ops.attention.plan import Tokens
from hyperpar_gdn.ops.attention.softmax import attention, doc_ids_tensor
from hyperpar_gdn.ops.prefill_states import PrefillStates
from hyperpar_gdn.platform import Tensor


class OwnAttention:
    """Adapter for ``hyperpar_gdn.models.attention.CausalSelfAttention`` and its MindSpore twin."""

    def __init__(self, module: Any) -> None:
        self.module = module

    def project(self, x_BTC: Tensor, *, position_offset: int, cos_sin: Any = None) -> tuple[Tensor, ...]:
        return self.module.project(x_BTC, position_offset=position_offset)

    def finish(self, o_BTX: Tensor, gate_BTX: Tensor) -> Tensor:
        return self.module.finish(o_BTX, gate_BTX)


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
    docs = None if seq.doc_ids is None else np.asarray(xp.to_numpy(seq.doc_ids)).reshape(-1)[:visible]
    queries = Tokens.span(offset, visible, None if docs is None else docs[offset:])
    keys = Tokens.span(0, visible, docs)
    key_mask = None if seq.key_mask is None else seq.key_mask[:, :visible]
    o_BHTD = attention(xp, q_BHTD, k_BHTD, v_BHTD, queries=queries, keys=keys, key_mask=key_mask)
    b, h, t, d = o_BHTD.shape
    o_BTX = xp.swapaxes(o_BHTD, 1, 2).reshape(b, t, h * d)
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
    docs = None if seq.doc_ids is None else np.asarray(xp.to_numpy(seq.doc_ids)).reshape(-1)
    queries = Tokens(positions, None if docs is None else docs[positions])
    keys = Tokens.span(0, tokens.seq_len, docs)
    o_BHTD = attention(
        xp, q_BHTD, kv_BHTD[:, :hkv], kv_BHTD[:, hkv:], queries=queries, keys=keys, key_mask=seq.key_mask
    )
    b, h, t, d = o_BHTD.shape
    return adapter.finish(xp.swapaxes(o_BHTD, 1, 2).reshape(b, t, h * d), gate)


class SoftmaxAttentionContextParallel(ParallelStyle):
    """Context parallelism for causal softmax attention layers: ours
    (:class:`~hyperpar_gdn.models.attention.CausalSelfAttention`, torch, and its MindSpore twin)
    and transformers' ``Qwen3_5Attention`` / ``Qwen3_5MoeAttention``. One implementation over the
    mesh's platform (its TensorOps and differentiable all-gather).

    After ``apply(module, mesh)`` the module's forward takes and returns this rank's shard
    ``[B, T_r, hidden]`` (shards may differ in length) and gives exactly the single-device rows;
    ours also take ``cu_seqlens=`` (packed documents: the whole sequence's boundaries). Both take
    ``prefill_states=`` (an inference prefill's record: handed K and V of the whole sequence in
    global order, on every rank).
    Parameters are untouched; their gradients are this rank's share (sum them over the CP ranks:
    :func:`~hyperpar_gdn.sync_context_parallel_grads`).
    ``undo(module)`` restores the original forward.

    transformers' layers keep their call signature ``(hidden_states, position_embeddings,
    attention_mask, ...)`` and return ``(output, None)``; ``position_embeddings`` must be the
    cos/sin of the shard's positions, and ``attention_mask`` the :class:`GlobalSequence` (lengths,
    padding, documents) that ``apply_context_parallel`` passes for a whole transformers model (a
    local 4-D mask cannot describe the keys of other ranks, so it is refused).

    ``layout``: ``"contiguous"`` or ``"head_tail"`` (:mod:`hyperpar_gdn.distributed.layout`),
    which tokens a rank holds.

    Example::

        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
        SoftmaxAttentionContextParallel().apply(attn, mesh)
        y_local = attn(x_local)        # x_local: [B, T/2, hidden]
    """

    def __init__(self, *, layout: str = "contiguous") -> None:
        self.layout = check_layout(layout)

    def apply(self, module: Any, mesh: Any) -> Any:
        cp_mesh = as_cp_mesh(mesh)
        if from_transformers(module):
            from hyperpar_gdn.integrations.transformers.attention import transformers_attention_forward

            return self._install(
                module,
                lambda original: transformers_attention_forward(module, cp_mesh, self.layout),
                layout=self.layout,
            )
        for name in ("project", "finish"):
            if not callable(getattr(module, name, None)):
                raise TypeError(
                    f"{type(module).__name__} has no {name}(): SoftmaxAttentionContextParallel supports "
                    "hyperpar_gdn.models.attention.CausalSelfAttention and transformers' Qwen3.5 attention"
                )
        adapter = OwnAttention(module)

        def forward(
            hidden_states: Tensor, *, cu_seqlens: Any = None, prefill_states: PrefillStates | None = None
        ) -> Tensor:
            error = shard_error(hidden_states, module.hidden_size)
            if error is None and cu_seqlens is not None and hidden_states.shape[0] != 1:
                error = f"packed documents (cu_seqlens) need batch size B=1; got B={hidden_states.shape[0]}"
            lengths = exchange_lengths(cp_mesh, None if error else hidden_states.shape[1], error)
            doc_ids = None
            if cu_seqlens is not None:
                xp = cp_mesh.platform.ops
                doc_ids = doc_ids_tensor(xp, cu_seqlens, seq_len=sum(lengths), like=hidden_states)
            seq = GlobalSequence(lengths, doc_ids=doc_ids, layout=self.layout)
            seq.token_layout()  # head_tail: every rank holds two equal pieces (the same error on every rank)
            return attention_forward(adapter, cp_mesh, hidden_states, seq, prefill_states=prefill_states)

        return self._install(module, lambda original: forward, layout=self.layout)


def shard_error(x_BTC: Tensor, hidden_size: int) -> str | None:
    shape = tuple(x_BTC.shape)
    if len(shape) != 3 or shape[-1] != hidden_size:
        return f"the local shard must be [B, T/cp, hidden_size={hidden_size}]; got {shape}"
    return None
