"""A CP prefill of a transformers Qwen3.5 causal LM: its text model's hidden states for a shard,
and transformers' own ``DynamicCache`` filled with the recorded states
(:func:`~hyperpar_gdn.prefill_context_parallel` calls these)."""

from __future__ import annotations

from typing import Any

import numpy as np

from hyperpar_gdn.distributed.decoder_layers import mixer_of
from hyperpar_gdn.integrations.transformers.discovery import CAUSAL_LMS
from hyperpar_gdn.ops.prefill_states import PrefillStates
from hyperpar_gdn.platform import Tensor, ops_for

__all__ = ["check_causal_lm", "dynamic_cache", "dynamic_caches", "prefill_hidden"]


def check_causal_lm(model: Any) -> None:
    if type(model).__name__ not in CAUSAL_LMS:
        raise NotImplementedError(
            f"prefill_context_parallel serves transformers' {' / '.join(CAUSAL_LMS)}; got {type(model).__name__}"
        )


def prefill_hidden(
    text_model: Any,
    input_ids: Tensor,
    mask_np: np.ndarray | None,
    index: np.ndarray,
    states: PrefillStates,
    positions: np.ndarray | None = None,
) -> Tensor:
    """This rank's final hidden states ``[B, T_r, C]`` through transformers' text model: the
    prompt's tokens at the global positions ``index`` (int ``[T_r]``, this rank's tokens in its
    layout) with the positions ``generate`` would give them (from the padding mask when there is
    one) or ``positions`` ``[1, T]`` (packed prompts: restarting at 0 per prompt); every mixer is
    handed ``states`` (the decoder layers pass their keywords on)."""
    xp = ops_for(input_ids)
    b, t = input_ids.shape
    if positions is None and mask_np is None:
        positions = np.tile(np.arange(t), (b, 1))
    elif positions is None:
        positions = np.where(mask_np, np.cumsum(mask_np, 1) - 1, 0)
    inputs = {
        "input_ids": xp.take(input_ids, index, 1),
        "position_ids": xp.constant(np.ascontiguousarray(positions[:, index]), like=input_ids),
        "prefill_states": states,
    }
    if mask_np is not None:
        inputs["attention_mask"] = xp.constant(mask_np[:, index].astype(np.int64), like=input_ids)
    return text_model(**inputs).last_hidden_state


def dynamic_cache(model: Any, text_model: Any, states: PrefillStates) -> Any:
    """transformers' ``DynamicCache`` for ``model`` holding the recorded states, filled through
    its own update methods as its prefill fills it."""
    return _filled_cache(model, text_model, states)


def dynamic_caches(model: Any, text_model: Any, states: PrefillStates, cu: np.ndarray) -> list[Any]:
    """One ``DynamicCache`` per packed prompt (bounds ``cu`` int ``[N+1]``): the GDN layers
    recorded a row per prompt (conv ``[N, C, W]``, S ``[N, H, K, V]``), the attention layers the K
    and V of the whole row ``[1, Hkv, T, D]``, cut at the bounds."""
    return [
        _filled_cache(model, text_model, states, prompt=(n, int(cu[n]), int(cu[n + 1])))
        for n in range(len(cu) - 1)
    ]


def _filled_cache(
    model: Any, text_model: Any, states: PrefillStates, *, prompt: tuple[int, int, int] | None = None
) -> Any:
    """A ``DynamicCache`` holding the recorded states: all of them, or with ``prompt`` = (n,
    start, stop) the GDN states of row n and the attention K/V of tokens [start, stop)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    for i, block in enumerate(text_model.layers):
        kind, module = mixer_of(i, block)
        if kind == "linear_attn":
            conv, s = states.gdn[id(module)]
            if prompt is not None:
                conv, s = conv[prompt[0] : prompt[0] + 1], s[prompt[0] : prompt[0] + 1]
            cache.update_conv_state(conv.to(module.conv1d.weight.dtype), i, conv_kernel_size=conv.shape[-1])
            cache.update_recurrent_state(s, i)
        else:
            k, v = states.kv[id(module)]
            if prompt is not None:
                k, v = (x[:, :, prompt[1] : prompt[2]].contiguous() for x in (k, v))
            cache.update(k, v, i)
    return cache
