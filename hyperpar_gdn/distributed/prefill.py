"""Prefill under context parallelism: read a long prompt on the CP ranks, hand its state to a
decoder on one device (DESIGN.md section 12).

    apply_context_parallel(model, mesh, mode="p2p")
    logits, cache = prefill_context_parallel(model, mesh, prompt_ids, attention_mask=mask)
    undo_context_parallel(model)
    out = model.generate(torch.cat([prompt_ids, logits.argmax(-1, keepdim=True)], 1),
                         attention_mask=..., cache=cache, max_new_tokens=15)

Every rank passes the whole prompt; rank r reads the r-th contiguous piece (the pieces differ by
at most one token, the longer ones first). While the prompt runs, every mixer hands its state of
the whole prompt to every rank (:mod:`hyperpar_gdn.ops.prefill_states`): a GDN layer's recurrent
state (p2p: the last rank's leaving state, summed with zeros from the others; all_gather: the fold
of the gathered summaries carried to the end, no communication; ulysses: each rank's heads ran
the whole prompt, one all-gather over heads) and its conv state (the last W pre-conv inputs, which
may span ranks, one small all-gather); an attention layer's K and V (the all-gather it does anyway,
of every rank's keys instead of the earlier ones). The logits of the last token come from the
last rank (only that token's row goes through the LM head).

Left padding (transformers' batched generation): ``attention_mask`` ``[B, T]``; positions are
``cumsum(mask) - 1`` (0 on padding), as ``generate`` makes them; the GDN layers zero the padded
inputs and the attention layers mask the padded keys, as transformers' own prefill does. The last
token of every row must be a token (no right padding).

Legend: B batch, T prompt tokens, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hyperpar_gdn.models.decoding import (
    check_prompt,
    inference_mode,
    last_hidden,
    lm_parts,
    state_from_prefill,
)
from hyperpar_gdn.ops.blocks import lm_logits
from hyperpar_gdn.ops.prefill_states import PrefillStates, record_prefill_states
from hyperpar_gdn.platform import Tensor, ops_for

from .mesh import as_cp_mesh
from .parallelize import TRANSFORMERS_TEXT_MODELS, _mixer, text_model_of
from .style import _HANDLE, applied_layout, prefill_layout_error

__all__ = ["prefill_context_parallel", "prompt_lengths"]

TRANSFORMERS_CAUSAL_LMS = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")


def prompt_lengths(seq_len: int, cp: int) -> list[int]:
    """How a prompt of ``seq_len`` tokens is cut over ``cp`` ranks: contiguous pieces differing
    by at most one token, the longer ones first (so the last piece is the shortest)."""
    if seq_len < cp:
        raise ValueError(f"a prompt of T={seq_len} tokens cannot give each of cp={cp} ranks a token")
    base, extra = divmod(seq_len, cp)
    return [base + (1 if r < extra else 0) for r in range(cp)]


def prefill_context_parallel(
    model: Any,
    mesh: Any,
    input_ids: Tensor,
    *,
    attention_mask: Tensor | None = None,
    lengths: Sequence[int] | None = None,
) -> tuple[Tensor, Any]:
    """Read a prompt under context parallelism; no gradients are kept.

    Args:
        model: under :func:`~hyperpar_gdn.apply_context_parallel` (any mode): transformers'
            ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM``, or ``HybridLM`` (torch or
            MindSpore) or the MindSpore ``Qwen3_5ForCausalLM``.
        mesh: the CP mesh the model was parallelized over.
        input_ids: the whole prompt ``[B, T]``, the same on every rank.
        attention_mask: ``[B, T]`` (1 = token, 0 = left padding), the same on every rank;
            transformers' models only.
        lengths: the tokens of each rank (contiguous, in rank order, summing to T); None:
            :func:`prompt_lengths`. p2p and all_gather need at least W-1 (the conv halo) per rank.

    Returns, on every rank, ``(logits, cache)``: the logits of the last prompt token ``[B, V]``
    (fp32 at least) and, for transformers' models, their ``DynamicCache`` filled as their own
    prefill fills it (after ``undo_context_parallel(model)`` one device continues with
    ``model(input_ids=next_ids, cache=cache, ...)`` or ``model.generate``); for ours a
    :class:`~hyperpar_gdn.models.decoding.DecodingState` (continue with
    :func:`~hyperpar_gdn.models.decoding.greedy_continue` or ``decode_step``).
    """
    cp_mesh = as_cp_mesh(mesh)
    check_prompt(input_ids)
    text_model = text_model_of(model)
    transformers_model = type(text_model).__name__ in TRANSFORMERS_TEXT_MODELS
    if transformers_model and type(model).__name__ not in TRANSFORMERS_CAUSAL_LMS:
        raise NotImplementedError(
            f"prefill_context_parallel serves transformers' {' / '.join(TRANSFORMERS_CAUSAL_LMS)}; "
            f"got {type(model).__name__}"
        )
    for i, block in enumerate(text_model.layers):
        if getattr(_mixer(i, block)[1], _HANDLE, None) is None:
            raise ValueError(
                f"layer {i} of {type(model).__name__} is not under context parallelism: call "
                "apply_context_parallel(model, mesh, mode=...) first"
            )
    for i, block in enumerate(text_model.layers):
        error = prefill_layout_error(applied_layout(_mixer(i, block)[1]) or "contiguous")
        if error is not None:
            raise ValueError(
                f"{error} (layer {i}): apply_context_parallel(model, mesh, mode=...) without layout="
            )
    b, t = (int(n) for n in input_ids.shape)
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    lengths = prompt_lengths(t, cp) if lengths is None else _check_lengths(lengths, t, cp)
    start, stop = sum(lengths[:rank]), sum(lengths[: rank + 1])
    xp = ops_for(input_ids)
    mask_np = None
    if attention_mask is not None:
        if not transformers_model:
            raise NotImplementedError(
                f"{type(model).__name__} takes no attention mask: pass prompts without padding"
            )
        if tuple(attention_mask.shape) != (b, t):
            raise ValueError(f"attention_mask must be [B, T] = {(b, t)}; got {tuple(attention_mask.shape)}")
        mask_np = xp.to_numpy(attention_mask) != 0
        if not mask_np[:, -1].all():
            rows = np.flatnonzero(~mask_np[:, -1]).tolist()
            raise ValueError(
                f"rows {rows} end in padding: a prompt is left-padded (its last token must be a token)"
            )
    with inference_mode(model), record_prefill_states() as states:
        if transformers_model:
            hidden = _transformers_hidden(text_model, input_ids, mask_np, start, stop)
            head = model.lm_head.weight
        else:
            parts = lm_parts(model)
            hidden = last_hidden(parts, input_ids[:, start:stop])
            head = parts.head
        hx = ops_for(hidden)
        last = lm_logits(hx, hidden[:, stop - start - 1 :], head)[:, 0]  # [B, V]
        if rank != cp - 1:
            last = hx.zeros(tuple(last.shape), like=last)
        if cp > 1:
            last = cp_mesh.platform.collectives.all_reduce_sum(last, cp_mesh.get_group())
    if transformers_model:
        return last, _transformers_cache(model, text_model, states)
    return last, state_from_prefill(model, states, t)


def _check_lengths(lengths: Sequence[int], seq_len: int, cp: int) -> list[int]:
    lengths = [int(n) for n in lengths]
    if len(lengths) != cp or sum(lengths) != seq_len or min(lengths) < 1:
        raise ValueError(
            f"lengths={lengths} must give each of cp={cp} ranks at least one token and sum to T={seq_len}"
        )
    return lengths


def _transformers_hidden(
    text_model: Any, input_ids: Tensor, mask_np: np.ndarray | None, start: int, stop: int
) -> Tensor:
    """This rank's final hidden states ``[B, T_r, C]`` through transformers' text model, with the
    global positions ``generate`` would give (from the padding mask when there is one)."""
    xp = ops_for(input_ids)
    b, t = input_ids.shape
    if mask_np is None:
        positions = np.tile(np.arange(t), (b, 1))
    else:
        positions = np.where(mask_np, np.cumsum(mask_np, 1) - 1, 0)
    inputs = {
        "input_ids": input_ids[:, start:stop],
        "position_ids": xp.constant(np.ascontiguousarray(positions[:, start:stop]), like=input_ids),
    }
    if mask_np is not None:
        inputs["attention_mask"] = xp.constant(mask_np[:, start:stop].astype(np.int64), like=input_ids)
    return text_model(**inputs).last_hidden_state


def _transformers_cache(model: Any, text_model: Any, states: PrefillStates) -> Any:
    """transformers' ``DynamicCache`` for ``model`` holding the recorded states, filled through
    its own update methods as its prefill fills it."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    for i, block in enumerate(text_model.layers):
        kind, module = _mixer(i, block)
        if kind == "linear_attn":
            conv, s = states.gdn[id(module)]
            cache.update_conv_state(conv.to(module.conv1d.weight.dtype), i, conv_kernel_size=conv.shape[-1])
            cache.update_recurrent_state(s, i)
        else:
            k, v = states.kv[id(module)]
            cache.update(k, v, i)
    return cache
