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

__all__ = [
    "check_causal_lm",
    "dynamic_cache",
    "dynamic_caches",
    "gdn_forward_with_cache",
    "prefill_hidden",
    "store_gdn_states",
]


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


def dynamic_cache(model: Any, text_model: Any, states: PrefillStates, *, tokens: int) -> Any:
    """transformers' ``DynamicCache`` for ``model`` holding the recorded states of a ``tokens``-token
    prompt, filled through its own update methods as its prefill fills it."""
    return _filled_cache(model, text_model, states, tokens=tokens)


def dynamic_caches(model: Any, text_model: Any, states: PrefillStates, cu: np.ndarray) -> list[Any]:
    """One ``DynamicCache`` per packed prompt (bounds ``cu`` int ``[N+1]``): the GDN layers
    recorded a row per prompt (conv ``[N, C, W]``, S ``[N, H, K, V]``), the attention layers the K
    and V of the whole row ``[1, Hkv, T, D]``, cut at the bounds."""
    return [
        _filled_cache(
            model, text_model, states, tokens=int(cu[n + 1] - cu[n]), prompt=(n, int(cu[n]), int(cu[n + 1]))
        )
        for n in range(len(cu) - 1)
    ]


def store_gdn_states(cache: Any, i: int, conv: Tensor, s: Tensor, *, tokens: int) -> None:
    """GDN layer ``i``'s conv state ``[B, C, W]`` and recurrent state S ``[B, H, K, V]`` after a
    ``tokens``-token prompt into a fresh layer of ``cache`` (a ``DynamicCache``).

    From transformers 5.25 a GDN layer of the cache counts its tokens (``get_seq_length``, where
    ``generate`` takes the next position from) by the conv inputs it is handed: a state of W
    columns would count W, so the count is set to ``tokens``. Older releases count the attention
    layers' keys only."""
    cache.update_conv_state(conv, i, conv_kernel_size=conv.shape[-1])
    cache.update_recurrent_state(s, i)
    count = getattr(cache.layers[i], "cumulative_length_linear", None)
    if count is not None:
        count.fill_(tokens)


def _filled_cache(
    model: Any,
    text_model: Any,
    states: PrefillStates,
    *,
    tokens: int,
    prompt: tuple[int, int, int] | None = None,
) -> Any:
    """A ``DynamicCache`` holding the recorded states of ``tokens`` tokens: all of them, or with
    ``prompt`` = (n, start, stop) the GDN states of row n and the attention K/V of tokens [start, stop)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    for i, block in enumerate(text_model.layers):
        kind, module = mixer_of(i, block)
        if kind == "linear_attn":
            conv, s = states.gdn[id(module)]
            if prompt is not None:
                conv, s = conv[prompt[0] : prompt[0] + 1], s[prompt[0] : prompt[0] + 1]
            store_gdn_states(cache, i, conv.to(module.conv1d.weight.dtype), s, tokens=tokens)
        else:
            k, v = states.kv[id(module)]
            if prompt is not None:
                k, v = (x[:, :, prompt[1] : prompt[2]].contiguous() for x in (k, v))
            cache.update(k, v, i)
    return cache


def gdn_forward_with_cache(
    module: Any, hidden_states: Tensor, attention_mask: Tensor | None, cache: Any, *, cu_seqlens: Any = None
) -> Tensor:
    """A transformers GDN layer's call with its ``DynamicCache``, computed by our layer maths on the
    layer's weights as :class:`~hyperpar_gdn.ops.gdn.layer.LayerWeights` gives them (under tensor
    parallelism this rank's heads, whose states the cache then holds): a prompt
    ``[B, T, hidden]`` with no state yet fills the layer's conv and recurrent states; one token
    ``[B, 1, hidden]`` after them steps from them (updated in place), as transformers' own cached
    forward does. Returns the layer's output ``[B, T, hidden]`` (this rank's share under TP)."""
    from hyperpar_gdn.ops.gdn.decode import gdn_decode_step
    from hyperpar_gdn.ops.gdn.kernels import platform_of, resolve_kernel
    from hyperpar_gdn.ops.gdn.layer import LayerDims, LayerWeights, layer_forward, mask_padding

    i, t = module.layer_idx, hidden_states.shape[1]
    conv = cache.get_conv_state(i)
    if conv is None:  # a prompt: read it whole, keep the states it leaves
        if cache.is_recording_past(i):
            raise NotImplementedError(f"{type(module).__name__} layer {i}: a cache recording past states")
        states = PrefillStates()
        y = layer_forward(module, hidden_states, attention_mask, cu_seqlens=cu_seqlens, prefill_states=states)
        conv, s = states.gdn[id(module)]
        store_gdn_states(cache, i, conv.to(hidden_states.dtype), s, tokens=t)
        return y
    if t != 1 or cu_seqlens is not None:
        raise NotImplementedError(
            f"{type(module).__name__} layer {i}: after its prompt the cache steps one token at a time; "
            f"got {t} tokens{' packed' if cu_seqlens is not None else ''}"
        )
    xp = ops_for(hidden_states)
    kernel = resolve_kernel("auto", platform=platform_of(hidden_states)).name
    y, new_conv, s = gdn_decode_step(
        xp,
        LayerWeights.of(module),
        LayerDims.of(module),
        mask_padding(xp, hidden_states, attention_mask),
        conv,
        cache.get_recurrent_state(i),
        kernel=kernel,
    )
    conv.copy_(new_conv)
    cache.update_recurrent_state(s, i)
    count = getattr(cache.layers[i], "cumulative_length_linear", None)  # transformers >= 5.25: one token more
    if count is not None:
        count.add_(1)
    return y
