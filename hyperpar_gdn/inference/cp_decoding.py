"""Decoding on the CP group: the softmax layers' key/value cache stays sharded over the ranks.

After a CP prefill (:func:`~hyperpar_gdn.prefill_context_parallel`) every rank holds the whole
prompt's state. A one-device decoder keeps all of it; at long context the attention layers' K/V
dominate (Qwen3.5-27B: 64 KiB per token, 16 GiB at 256K) while a GDN layer's state is a constant
size. Here every rank keeps only its share of K/V (:func:`shard_cache`) and each decoding step:

- runs the whole model on the new token on every rank (its activations are one token: replicated),
  the GDN layers stepping on their replicated states;
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

The algorithm (the cut, the owner rule, :func:`sharded_attention`) is written once here; a model
family says only how its cache is cut and how one token steps through it with ``attend`` in
place of its attention: transformers' Qwen3.5 causal LMs (dense and MoE;
:mod:`hyperpar_gdn.integrations.transformers.sharded_cache`, their GDN layers through their own
cached step, their attention layers' forwards replaced only while a step runs) and this package's
LMs (``HybridLM``, torch or MindSpore, and the MindSpore ``Qwen3_5ForCausalLM``;
:func:`~hyperpar_gdn.inference.decoding.step_blocks`). Prompts without padding, greedy decoding
(or the logits of one step). The model must be back on one device's forward
(``undo_context_parallel(model)``).

Legend: B batch, T prompt tokens, V vocabulary, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hyperpar_gdn.distributed.decoder_layers import mixer_of, module_adapter_for, text_model_of
from hyperpar_gdn.distributed.mesh import as_cp_mesh
from hyperpar_gdn.distributed.parallel_style import is_parallelized
from hyperpar_gdn.inference.decoding import (
    DecodingState,
    check_step_ids,
    greedy_tokens,
    lm_parts,
    step_blocks,
)
from hyperpar_gdn.inference.prefill import prompt_lengths
from hyperpar_gdn.ops.attention.partials import merge_partials, partial_attention
from hyperpar_gdn.ops.prefill_states import check_cached_tokens
from hyperpar_gdn.platform import Tensor, ops_for

__all__ = [
    "ShardedCache",
    "check_sharded_decoding",
    "decode_step_context_parallel",
    "greedy_continue_context_parallel",
    "kv_tokens_per_rank",
    "shard_cache",
    "sharded_attention",
]


@dataclass
class ShardedCache:
    """The decoding state of a CP group, on one rank.

    Attributes:
        gdn: the GDN layers' states, the same on every rank: transformers' ``DynamicCache`` (its
            attention layers stay empty), or for our LMs by layer index ``(conv [B, C, W],
            S [B, H, K, V])``.
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
        return sum(int(t.nbytes) for t in (*self.keys.values(), *self.values.values()))


def shard_cache(model: Any, mesh: Any, cache: Any, *, length: int) -> ShardedCache:
    """This rank's :class:`ShardedCache` from the cache a CP prefill of ``length`` tokens returned
    (the same on every rank: transformers' ``DynamicCache``, or our LMs'
    :class:`~hyperpar_gdn.inference.decoding.DecodingState`): the GDN states are kept, the
    attention layers' K/V cut to this rank's contiguous piece
    (:func:`~hyperpar_gdn.inference.prefill.prompt_lengths`, copied); the rest is dropped."""
    check_sharded_decoding(model)
    cp_mesh = as_cp_mesh(mesh)
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    pieces = prompt_lengths(length, cp)
    start, stop = sum(pieces[:rank]), sum(pieces[: rank + 1])
    family = module_adapter_for(model).inference()  # None: this library's own LMs
    if family is not None and family.decodes(model):
        gdn, keys, values = family.cut_cache(model, cache, length=length, start=start, stop=stop)
    else:
        gdn, keys, values = _cut_state(model, cache, length=length, start=start, stop=stop)
    return ShardedCache(gdn=gdn, keys=keys, values=values, length=length, cp=cp, rank=rank)


def _cut_state(
    model: Any, state: Any, *, length: int, start: int, stop: int
) -> tuple[dict[int, tuple[Tensor, Tensor]], dict[int, Tensor], dict[int, Tensor]]:
    """:func:`shard_cache` for our LMs, from their :class:`DecodingState`."""
    if not isinstance(state, DecodingState) or state.length != length:
        found = f"length={state.length}" if isinstance(state, DecodingState) else type(state).__name__
        raise ValueError(
            f"{type(model).__name__} decodes from the DecodingState of its prefill of length={length}; "
            f"got {found}"
        )
    gdn, keys, values = {}, {}, {}
    for i, (block, (first, second)) in enumerate(zip(lm_parts(model).blocks, state.layers, strict=True)):
        if block.layer_type == "linear_attention":
            gdn[i] = (first, second)
        else:
            check_cached_tokens(i, first.shape[2], length)
            xp, mine = ops_for(first), np.arange(start, stop)
            keys[i], values[i] = xp.take(first, mine, 2), xp.take(second, mine, 2)
    return gdn, keys, values


def check_sharded_decoding(model: Any) -> None:
    """Refuse a model that has no sharded cache here, or one still under context parallelism
    (the same error on every rank)."""
    mixers = _mixers(model)
    if mixers is None:
        raise NotImplementedError(
            f"decoding on the CP group keeps the caches of transformers' Qwen3.5 causal LMs and of this "
            f"package's LMs sharded; {type(model).__name__} has no sharded cache: decode on one device"
        )
    for i, mixer in enumerate(mixers):
        if is_parallelized(mixer):
            raise ValueError(
                f"layer {i} is still under context parallelism: call undo_context_parallel(model) after "
                "the prefill, before decoding on the CP group"
            )


def _mixers(model: Any) -> list[Any] | None:
    """The token mixers of a model decoding on the CP group serves, by layer; None for others."""
    family = module_adapter_for(model).inference()
    if family is not None and family.decodes(model):
        return [mixer_of(i, block)[1] for i, block in enumerate(text_model_of(model).layers)]
    if family is not None:
        return None
    try:
        blocks = lm_parts(model).blocks
    except TypeError:
        return None
    if not all(hasattr(block, "layer_type") and hasattr(block, "mixer") for block in blocks):
        return None
    return [block.mixer for block in blocks]


def sharded_attention(
    cp_mesh: Any, state: ShardedCache, i: int, q: Tensor, k: Tensor, v: Tensor, *, scale: float
) -> Tensor:
    """Attention layer ``i``'s step on the CP group, for the new token at ``state.length``: q
    ``[B, H, 1, D]``, its k and v ``[B, Hkv, 1, D]`` (rotated) -> o ``[B, 1, H*D]`` in q's dtype.
    The rank ``length mod cp`` keeps k and v; every rank attends q over its keys (a partial and its
    log-sum-exp); one all-gather of ``[B, H, 1, D+1]``; the partials merged by log-sum-exp."""
    xp = ops_for(q)
    if state.rank == state.length % state.cp:
        state.keys[i] = xp.cat([state.keys[i], k], 2)
        state.values[i] = xp.cat([state.values[i], v], 2)
    o, lse = partial_attention(xp, q, state.keys[i], state.values[i], scale=scale)
    both = xp.cat([o, lse], -1)
    if state.cp > 1:
        parts = cp_mesh.platform.collectives.all_gather(both, cp_mesh.get_group())
    else:
        parts = both[None]
    b, h, t, d = o.shape
    o = merge_partials(xp, parts[..., :d], parts[..., d:])  # [B, H, 1, D]
    return xp.cast(xp.swapaxes(o, 1, 2).reshape(b, t, h * d), xp.dtype(q))


def decode_step_context_parallel(
    model: Any, mesh: Any, state: ShardedCache, ids_B1: Tensor, *, gdn_kernel: str = "auto"
) -> Tensor:
    """One token per row ``[B, 1]`` at position ``state.length`` on every rank of the CP group ->
    its logits ``[B, V]`` (the same on every rank); ``state`` moves on by one token.
    ``gdn_kernel``: our models' GDN step (:func:`~hyperpar_gdn.inference.decoding.decode_step`);
    transformers' models step through their own layers."""
    check_step_ids(ids_B1)
    cp_mesh = as_cp_mesh(mesh)
    if (cp_mesh.size(), cp_mesh.get_local_rank()) != (state.cp, state.rank):
        raise ValueError(
            f"the sharded cache was cut for cp={state.cp} rank {state.rank}; this mesh is "
            f"cp={cp_mesh.size()} rank {cp_mesh.get_local_rank()}"
        )

    def attend(i: int, q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None) -> Tensor:
        scale = q.shape[-1] ** -0.5 if scale is None else scale  # ours: causal_attention's D**-0.5
        return sharded_attention(cp_mesh, state, i, q, k, v, scale=scale)

    family = module_adapter_for(model).inference()
    if family is not None and family.decodes(model):
        logits = family.step(model, state.gdn, ids_B1, position=state.length, attend=attend)
    else:
        logits, state.gdn = step_blocks(
            model, ids_B1, position=state.length, gdn=state.gdn, attend=attend, gdn_kernel=gdn_kernel
        )
    state.length += 1
    return logits


def greedy_continue_context_parallel(
    model: Any,
    mesh: Any,
    logits_BV: Tensor,
    state: ShardedCache,
    *,
    max_new_tokens: int,
    gdn_kernel: str = "auto",
) -> Tensor:
    """Greedy continuation on the CP group from the prefill's last logits ``[B, V]`` -> the new
    tokens ``[B, max_new_tokens]`` (int64, on the logits' device), the same on every rank;
    ``gdn_kernel`` as in :func:`decode_step_context_parallel`."""
    return greedy_tokens(
        logits_BV,
        lambda ids_B1: decode_step_context_parallel(model, mesh, state, ids_B1, gdn_kernel=gdn_kernel),
        max_new_tokens=max_new_tokens,
    )


def kv_tokens_per_rank(length: int, cp: int) -> np.ndarray:
    """How many tokens of K/V each rank keeps once ``length`` tokens (prompt and new ones) are in
    the cache: ``len(range(r, length, cp))``, within one of ``length / cp``."""
    return np.array([len(range(r, length, cp)) for r in range(cp)])
