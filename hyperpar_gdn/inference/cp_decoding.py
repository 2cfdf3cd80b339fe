"""Decoding on the CP group: the softmax layers' key/value cache stays sharded over the ranks.

After a CP prefill (:func:`~hyperpar_gdn.prefill_context_parallel`) every rank holds the whole
prompt's state. A one-device decoder keeps all of it; at long context the attention layers' K/V
dominate (Qwen3.5-27B: 64 KiB per token, 16 GiB at 256K) while a GDN layer's state is a constant
size. Here every rank keeps only its share of K/V (:func:`shard_cache`) and each decoding step:

- runs the whole model on the new token on every rank (its activations are one token: replicated),
  the GDN layers through transformers' own cached step on their replicated states;
- in every attention layer, computes the new token's K/V, keeps them on one rank (below), attends
  the query over this rank's keys only (a partial output and its log-sum-exp,
  :func:`~hyperpar_gdn.ops.attention.partials.partial_attention`) and merges the ranks' partials
  by log-sum-exp after one all-gather of ``[B, H, 1, D+1]`` per layer.

Which rank keeps a new token: the token at position p is kept by rank ``p mod cp``. The prompt's
keys are cut into contiguous pieces, the longer ones first
(:func:`~hyperpar_gdn.inference.prefill.prompt_lengths`), so this rule fills the shortest pieces
first and keeps every rank's count within one token of the others at every step: the memory per
rank is ``ceil((T + new) / cp)`` tokens of K/V and no rank becomes the bottleneck. Appending to the
last rank instead would grow one rank by every new token. Every rank computes the new token's K/V
anyway (its activations are replicated), so the rule costs no communication.

Supported: transformers' Qwen3.5 causal LMs (dense and MoE), prompts without padding, greedy
decoding. The model must be back on one device's forward (``undo_context_parallel(model)``):
the attention layers' forwards are replaced only while a step runs.

Legend: B batch, T prompt tokens, V vocabulary, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from hyperpar_gdn.distributed.decoder_layers import mixer_of, text_model_of
from hyperpar_gdn.distributed.mesh import as_cp_mesh
from hyperpar_gdn.distributed.parallel_style import from_transformers, is_parallelized
from hyperpar_gdn.inference.prefill import prompt_lengths
from hyperpar_gdn.ops.attention.partials import merge_partials, partial_attention
from hyperpar_gdn.platform import Tensor, ops_for

__all__ = [
    "ShardedCache",
    "decode_step_context_parallel",
    "greedy_continue_context_parallel",
    "kv_tokens_per_rank",
    "shard_cache",
]


@dataclass
class ShardedCache:
    """The decoding state of a CP group, on one rank.

    Attributes:
        gdn: transformers' ``DynamicCache`` holding the GDN layers' conv and recurrent states (the
            same on every rank; its attention layers stay empty).
        keys, values: by attention layer index, this rank's K and V ``[B, Hkv, n_r, D]``.
        length: tokens read so far; the next token sits at this position.
        cp, rank: the CP group it was cut for.
    """

    gdn: Any
    keys: dict[int, Tensor]
    values: dict[int, Tensor]
    length: int
    cp: int
    rank: int

    def kv_bytes(self) -> int:
        """This rank's K/V cache in bytes."""
        return sum(int(t.numel()) * t.element_size() for t in (*self.keys.values(), *self.values.values()))


def shard_cache(model: Any, mesh: Any, cache: Any, *, length: int) -> ShardedCache:
    """This rank's :class:`ShardedCache` from the ``DynamicCache`` a CP prefill of ``length``
    tokens returned (the same on every rank): the GDN states are kept, the attention layers' K/V
    cut to this rank's contiguous piece (:func:`~hyperpar_gdn.inference.prefill.prompt_lengths`);
    the rest is dropped."""
    from transformers import DynamicCache

    check_sharded_decoding(model)
    cp_mesh = as_cp_mesh(mesh)
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    pieces = prompt_lengths(length, cp)
    start, stop = sum(pieces[:rank]), sum(pieces[: rank + 1])
    gdn = DynamicCache(config=model.config)
    keys, values = {}, {}
    for i, block in enumerate(text_model_of(model).layers):
        kind, module = mixer_of(i, block)
        layer = cache.layers[i]
        if kind == "linear_attn":
            conv = layer.conv_states[0]
            gdn.update_conv_state(conv, i, conv_kernel_size=conv.shape[-1])
            gdn.update_recurrent_state(layer.recurrent_states[0], i)
        else:
            if layer.keys.shape[2] != length:
                raise ValueError(
                    f"layer {i} of the cache holds {layer.keys.shape[2]} tokens, not length={length}"
                )
            keys[i] = layer.keys[:, :, start:stop].clone()
            values[i] = layer.values[:, :, start:stop].clone()
    return ShardedCache(gdn=gdn, keys=keys, values=values, length=length, cp=cp, rank=rank)


def check_sharded_decoding(model: Any) -> None:
    """Refuse a model that has no sharded cache here (the same error on every rank)."""
    if not from_transformers(model) or not hasattr(model, "lm_head"):
        raise NotImplementedError(
            f"decoding on the CP group keeps transformers' Qwen3.5 causal LM caches sharded; "
            f"{type(model).__name__} has no sharded cache: decode on one device "
            "(hyperpar_gdn.inference.decoding.greedy_continue)"
        )
    for i, block in enumerate(text_model_of(model).layers):
        if is_parallelized(mixer_of(i, block)[1]):
            raise ValueError(
                f"layer {i} is still under context parallelism: call undo_context_parallel(model) after "
                "the prefill, before decoding on the CP group"
            )


@contextmanager
def _sharded_attention(model: Any, mesh: Any, state: ShardedCache) -> Iterator[None]:
    """Every attention layer's forward replaced, for one step, by the sharded one; restored after."""
    from hyperpar_gdn.integrations.transformers.attention import TransformersAttention

    cp_mesh = as_cp_mesh(mesh)
    group, comm = cp_mesh.get_group(), cp_mesh.platform.collectives
    owner = state.length % state.cp  # the rank that keeps the new token
    replaced = []

    def make(i: int, module: Any) -> Any:
        adapter = TransformersAttention(module)

        def forward(hidden_states: Tensor, position_embeddings: Any, *args: Any, **kwargs: Any) -> Any:
            xp = ops_for(hidden_states)
            q, k, v, gate = adapter.project(
                hidden_states, position_offset=state.length, cos_sin=position_embeddings
            )
            if state.rank == owner:
                state.keys[i] = xp.cat([state.keys[i], k], 2)
                state.values[i] = xp.cat([state.values[i], v], 2)
            o, lse = partial_attention(xp, q, state.keys[i], state.values[i], scale=module.scaling)
            parts = (
                comm.all_gather(xp.cat([o, lse], -1), group) if state.cp > 1 else xp.cat([o, lse], -1)[None]
            )
            d = o.shape[-1]
            o = merge_partials(xp, parts[..., :d], parts[..., d:])  # [B, H, 1, D]
            b, h, t, _ = o.shape
            o_BTX = xp.cast(xp.swapaxes(o, 1, 2).reshape(b, t, h * d), xp.dtype(hidden_states))
            return adapter.finish(o_BTX, gate), None

        return forward

    try:
        for i, block in enumerate(text_model_of(model).layers):
            kind, module = mixer_of(i, block)
            if kind == "self_attn":
                module.forward = make(i, module)
                replaced.append(module)
        yield
    finally:
        for module in replaced:
            del module.forward


def decode_step_context_parallel(model: Any, mesh: Any, state: ShardedCache, ids_B1: Tensor) -> Tensor:
    """One token per row ``[B, 1]`` at position ``state.length`` on every rank of the CP group ->
    its logits ``[B, V]`` (the same on every rank); ``state`` moves on by one token."""
    import torch

    if len(ids_B1.shape) != 2 or ids_B1.shape[1] != 1:
        raise ValueError(f"a decoding step takes one token per row, [B, 1]; got shape {tuple(ids_B1.shape)}")
    cp_mesh = as_cp_mesh(mesh)
    if (cp_mesh.size(), cp_mesh.get_local_rank()) != (state.cp, state.rank):
        raise ValueError(
            f"the sharded cache was cut for cp={state.cp} rank {state.rank}; this mesh is "
            f"cp={cp_mesh.size()} rank {cp_mesh.get_local_rank()}"
        )
    b = ids_B1.shape[0]
    positions = torch.full((b, 1), state.length, dtype=torch.int64, device=ids_B1.device)
    no_masks = {"full_attention": None, "linear_attention": None}
    with torch.no_grad(), _sharded_attention(model, mesh, state):
        hidden = text_model_of(model)(
            input_ids=ids_B1, position_ids=positions, attention_mask=no_masks, cache=state.gdn, use_cache=True
        ).last_hidden_state
        logits = model.lm_head(hidden[:, -1])
    state.length += 1
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


def greedy_continue_context_parallel(
    model: Any, mesh: Any, logits_BV: Tensor, state: ShardedCache, *, max_new_tokens: int
) -> Tensor:
    """Greedy continuation on the CP group from the prefill's last logits ``[B, V]`` -> the new
    tokens ``[B, max_new_tokens]`` (int64), the same on every rank."""
    import torch

    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int; got {max_new_tokens!r}")
    tokens = []
    for step in range(max_new_tokens):
        next_ids = logits_BV.argmax(-1, keepdim=True)
        tokens.append(next_ids)
        if step + 1 < max_new_tokens:
            logits_BV = decode_step_context_parallel(model, mesh, state, next_ids)
    return torch.cat(tokens, 1)


def kv_tokens_per_rank(length: int, cp: int) -> np.ndarray:
    """How many tokens of K/V each rank keeps once ``length`` tokens (prompt and new ones) are in
    the cache: ``len(range(r, length, cp))``, within one of ``length / cp``."""
    return np.array([len(range(r, length, cp)) for r in range(cp)])
