"""Decoding on the CP group for transformers' Qwen3.5 causal LMs: how their ``DynamicCache`` is
cut to a rank's share and how one token steps through their model with the attention layers
replaced (:mod:`hyperpar_gdn.inference.cp_decoding` holds the algorithm; this file only says where
transformers keeps things).

Legend: B batch, T prompt tokens, V vocabulary, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from hyperpar_gdn.distributed.decoder_layers import mixer_of, text_model_of
from hyperpar_gdn.integrations.transformers.cache import store_gdn_states
from hyperpar_gdn.integrations.transformers.discovery import from_transformers
from hyperpar_gdn.ops.prefill_states import check_cached_tokens
from hyperpar_gdn.platform import Tensor

__all__ = ["cut_cache", "is_causal_lm", "step"]

# attend(i, q [B, H, 1, D], k [B, Hkv, 1, D], v, *, scale) -> o [B, 1, H*D]
Attend = Callable[..., Tensor]


def is_causal_lm(model: Any) -> bool:
    """Whether ``model`` is a transformers Qwen3.5 model with an LM head."""
    return from_transformers(model) and hasattr(model, "lm_head")


def cut_cache(
    model: Any, cache: Any, *, length: int, start: int, stop: int
) -> tuple[Any, dict[int, Tensor], dict[int, Tensor]]:
    """From the ``DynamicCache`` of a ``length``-token prefill -> (a ``DynamicCache`` holding only
    the GDN layers' states, and by attention layer index the K and V of tokens ``[start, stop)``
    ``[B, Hkv, stop - start, D]``, copied so that the whole prompt's K/V can be freed)."""
    from transformers import DynamicCache

    gdn = DynamicCache(config=model.config)
    keys, values = {}, {}
    for i, block in enumerate(text_model_of(model).layers):
        kind, _ = mixer_of(i, block)
        layer = cache.layers[i]
        if kind == "linear_attn":
            store_gdn_states(gdn, i, layer.conv_states[0], layer.recurrent_states[0], tokens=length)
        else:
            check_cached_tokens(i, layer.keys.shape[2], length)
            keys[i] = layer.keys[:, :, start:stop].clone()
            values[i] = layer.values[:, :, start:stop].clone()
    return gdn, keys, values


@contextmanager
def _attention_replaced(model: Any, position: int, attend: Attend) -> Iterator[None]:
    """Every attention layer's forward replaced, for one step, by ``attend``; restored after."""
    from hyperpar_gdn.integrations.transformers.attention import TransformersAttention

    replaced = []

    def make(i: int, module: Any) -> Any:
        adapter = TransformersAttention(module)

        def forward(hidden_states: Tensor, position_embeddings: Any, *args: Any, **kwargs: Any) -> Any:
            q, k, v, gate = adapter.project(
                hidden_states, position_offset=position, cos_sin=position_embeddings
            )
            o_BTX = attend(i, q, k, v, scale=module.scaling)
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


def step(model: Any, gdn: Any, ids_B1: Tensor, *, position: int, attend: Attend) -> Tensor:
    """One token per row ``[B, 1]`` at ``position`` through transformers' model: the GDN layers
    step on ``gdn`` (a ``DynamicCache``, updated in place), the attention layers call ``attend``
    -> logits ``[B, V]`` (fp32 at least)."""
    import torch

    b = ids_B1.shape[0]
    positions = torch.full((b, 1), position, dtype=torch.int64, device=ids_B1.device)
    no_masks = {"full_attention": None, "linear_attention": None}
    with torch.no_grad(), _attention_replaced(model, position, attend):
        hidden = text_model_of(model)(
            input_ids=ids_B1, position_ids=positions, attention_mask=no_masks, cache=gdn, use_cache=True
        ).last_hidden_state
        logits = model.lm_head(hidden[:, -1])
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
