"""Prefill under context parallelism: read a long prompt on the CP ranks, hand its state to a
decoder on one device (docs/inference.md).

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

from hyperpar_gdn.distributed.adapters import FamilyInference
from hyperpar_gdn.distributed.decoder_layers import base_model_of, mixer_of, module_adapter_for, text_model_of
from hyperpar_gdn.distributed.layout import TokenLayout, layout_error
from hyperpar_gdn.distributed.mesh import as_cp_mesh
from hyperpar_gdn.distributed.parallel_style import applied_layout, is_parallelized
from hyperpar_gdn.inference.decoding import (
    check_prompt,
    inference_mode,
    last_hidden,
    lm_parts,
    state_from_prefill,
)
from hyperpar_gdn.inference.packed import packed_bounds, packed_positions
from hyperpar_gdn.ops.prefill_states import PrefillStates
from hyperpar_gdn.ops.projections import Projection, WeightLinear
from hyperpar_gdn.platform import Tensor, ops_for

__all__ = ["prefill_context_parallel", "prompt_lengths"]


def prompt_lengths(seq_len: int, cp: int) -> list[int]:
    """How a prompt of ``seq_len`` tokens is cut over ``cp`` ranks: contiguous pieces differing
    by at most one token, the longer ones first (so the last piece is the shortest)."""
    if seq_len < cp:
        raise ValueError(f"a prompt of T={seq_len} tokens cannot give each of cp={cp} ranks a token")
    base, extra = divmod(seq_len, cp)
    return [base + (1 if r < extra else 0) for r in range(cp)]


# Long for its docstring (31 of its 83 lines): the public entry point documents every argument.
def prefill_context_parallel(
    model: Any,
    mesh: Any,
    input_ids: Tensor,
    *,
    attention_mask: Tensor | None = None,
    lengths: Sequence[int] | None = None,
    cu_seqlens: Any = None,
    position_ids: Tensor | None = None,
) -> tuple[Tensor, Any]:
    """Read a prompt (or N prompts packed in one row) under context parallelism; no gradients
    are kept.

    Args:
        model: under :func:`~hyperpar_gdn.apply_context_parallel` (any mode, either layout):
            transformers' ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM``, or ``HybridLM``
            (torch or MindSpore) or the MindSpore ``Qwen3_5ForCausalLM``; a transformers model may sit
            inside PEFT's ``PeftModel`` (its adapters apply, the head's included).
        mesh: the CP mesh the model was parallelized over.
        input_ids: the whole prompt ``[B, T]``, the same on every rank (``layout="head_tail"``:
            T divisible by 2*cp).
        attention_mask: ``[B, T]`` (1 = token, 0 = left padding), the same on every rank;
            transformers' models only.
        lengths: the tokens of each rank (contiguous layout only; in rank order, summing to T);
            None: :func:`prompt_lengths`. p2p and all_gather need at least W-1 (the conv halo)
            per rank (per piece in head_tail).
        cu_seqlens, position_ids: packed prompts (transformers' models, contiguous layout):
            ``input_ids`` ``[1, T]`` holds N prompts, prompt n is tokens
            ``[cu_seqlens[n], cu_seqlens[n+1])`` (int ``[N+1]``), or ``position_ids`` ``[1, T]``
            count 0, 1, ... within each prompt (:mod:`hyperpar_gdn.inference.packed`). Each prompt
            is read as if alone.

    Returns, on every rank, ``(logits, cache)``: the logits of the last prompt token ``[B, V]``
    (fp32 at least) and, for transformers' models, their ``DynamicCache`` filled as their own
    prefill fills it (after ``undo_context_parallel(model)`` one device continues with
    ``model(input_ids=next_ids, cache=cache, ...)`` or ``model.generate``); for ours a
    :class:`~hyperpar_gdn.inference.decoding.DecodingState` (continue with
    :func:`~hyperpar_gdn.inference.decoding.greedy_continue` or ``decode_step``). The cache is
    the same whichever layout and mode the model was parallelized with. Packed prompts:
    ``(logits [N, V], caches)``, ``caches[n]`` the ``DynamicCache`` of prompt n alone (continue
    it with ``generate`` from that prompt, as from the prompt's own prefill).
    """
    # Over 80 lines with its docstring: the checks every rank makes before any communication, then
    # the one forward; each check is a helper below.
    cp_mesh = as_cp_mesh(mesh)
    check_prompt(input_ids)
    model = base_model_of(model)  # a PeftModel: the transformers model it wraps (adapters inside)
    text_model = text_model_of(model)
    family = module_adapter_for(model).inference()  # None: this library's own LMs
    if family is not None:
        family.check_prefill(model)
    b, t = (int(n) for n in input_ids.shape)
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    layout = model_layout(model, text_model)
    xp = ops_for(input_ids)
    cu = None
    if cu_seqlens is not None or position_ids is not None:
        cu = _check_packed(model, family, xp, input_ids, layout, attention_mask, cu_seqlens, position_ids)
    check_position_range(model, t if cu is None else int(np.diff(cu).max()))
    tokens = prompt_layout(layout, t, cp, lengths)
    index = tokens.positions(rank)  # this rank's tokens, by global position
    mask_np = None if attention_mask is None else padding_mask(xp, attention_mask, (b, t))
    if family is None and attention_mask is not None:
        raise NotImplementedError(
            f"{type(model).__name__} takes no attention mask: pass prompts without padding"
        )
    ends = [t - 1] if cu is None else [int(c) - 1 for c in cu[1:]]  # the tokens whose logits we return
    states = PrefillStates()
    with inference_mode(model):
        if family is not None:
            positions = None if cu is None else packed_positions(cu)
            hidden = family.prefill_hidden(text_model, input_ids, mask_np, index, states, positions)
            head = family.head(model)
        else:
            parts = lm_parts(model)
            hidden = last_hidden(parts, _take_tokens(xp, input_ids, index), states)
            head = WeightLinear(parts.head)
        logits = _end_logits(cp_mesh, hidden, head, index, ends)  # [B, len(ends), V]
    if cu is not None:
        return logits[0], family.caches(model, text_model, states, cu)
    if family is not None:
        return logits[:, 0], family.cache(model, text_model, states, tokens=t)
    return logits[:, 0], state_from_prefill(model, states, t)


def _end_logits(cp_mesh: Any, hidden: Tensor, head: Projection, index: np.ndarray, ends: list[int]) -> Tensor:
    """The logits ``[B, E, V]`` (fp32 at least) of the tokens at global positions ``ends`` (E of
    them) on every rank: each from the rank holding it (``index``: this rank's global positions),
    zeros from the others, summed. ``head``: ``[..., C] -> [..., V]``."""
    hx = ops_for(hidden)
    where = {int(p): i for i, p in enumerate(index)}
    rows = []
    for end in ends:
        i = where.get(end, len(index) - 1)  # any row of ours stands in; it is zeroed below
        logits = head(hidden[:, i : i + 1])[:, 0]  # [B, V]
        logits = hx.cast(logits, hx.compute_dtype(logits))
        rows.append(logits if end in where else hx.zeros(tuple(logits.shape), like=logits))
    out = hx.stack(rows, 1)
    if cp_mesh.size() > 1:
        out = cp_mesh.platform.collectives.all_reduce_sum(out, cp_mesh.get_group())
    return out


def _check_packed(
    model: Any,
    family: FamilyInference | None,
    xp: Any,
    input_ids: Tensor,
    layout: str,
    attention_mask: Tensor | None,
    cu_seqlens: Any,
    position_ids: Tensor | None,
) -> np.ndarray:
    """The bounds of packed prompts, after the rules only a packed prefill has (the same
    ValueError or NotImplementedError on every rank, before any communication)."""
    if family is None:
        raise NotImplementedError(
            f"packed prompts are supported for transformers' Qwen3.5 models; {type(model).__name__} "
            "has no per-prompt positions: prefill its prompts one by one"
        )
    if attention_mask is not None:
        raise ValueError(
            "packed prompts have no padding: pass cu_seqlens or position_ids, not attention_mask"
        )
    if layout != "contiguous":
        raise ValueError(
            f"packed prompts need a model parallelized with layout='contiguous'; got layout={layout!r}"
        )
    return packed_bounds(xp, input_ids, cu_seqlens=cu_seqlens, position_ids=position_ids)


def model_layout(model: Any, text_model: Any) -> str:
    """The token layout every mixer of ``model`` was parallelized with (a ValueError naming the
    layer when one is not under context parallelism or the layouts differ)."""
    layouts = []
    for i, block in enumerate(text_model.layers):
        module = mixer_of(i, block)[1]
        if not is_parallelized(module):
            raise ValueError(
                f"layer {i} of {type(model).__name__} is not under context parallelism: call "
                "apply_context_parallel(model, mesh, mode=...) first"
            )
        layouts.append(applied_layout(module) or "contiguous")
    if len(set(layouts)) > 1:
        raise ValueError(
            f"the layers of {type(model).__name__} were parallelized with different layouts {layouts}"
        )
    return layouts[0]


def check_position_range(model: Any, seq_len: int) -> None:
    """Refuse a prompt longer than the model's position range (``max_position_embeddings`` of
    its config, when it has one)."""
    config = getattr(model, "config", None)
    config = getattr(config, "get_text_config", lambda: config)()
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and seq_len > limit:
        raise ValueError(
            f"the prompt has T={seq_len} tokens, more than the model's position range "
            f"max_position_embeddings={limit}"
        )


def prompt_layout(layout: str, seq_len: int, cp: int, lengths: Sequence[int] | None) -> TokenLayout:
    """Which tokens of a ``seq_len`` prompt each rank reads (the same ValueError on every rank)."""
    if layout == "head_tail":
        if lengths is not None:
            raise ValueError(
                f"lengths={list(lengths)} chooses contiguous pieces; a model parallelized with "
                "layout='head_tail' reads 2*cp equal pieces (pass lengths=None)"
            )
        error = layout_error(layout, seq_len, cp)
        if error is not None:
            raise ValueError(f"{error}: pad the prompt on the left or apply layout='contiguous'")
        return TokenLayout.of(layout, [seq_len // cp] * cp)
    lengths = prompt_lengths(seq_len, cp) if lengths is None else _check_lengths(lengths, seq_len, cp)
    return TokenLayout.of(layout, lengths)


def padding_mask(xp: Any, attention_mask: Tensor, shape: tuple[int, int]) -> np.ndarray:
    """The left-padding mask as bool ``[B, T]`` (ValueError when its shape is not ``shape`` or a
    row ends in padding)."""
    if tuple(attention_mask.shape) != shape:
        raise ValueError(f"attention_mask must be [B, T] = {shape}; got {tuple(attention_mask.shape)}")
    mask_np = xp.to_numpy(attention_mask) != 0
    if not mask_np[:, -1].all():
        rows = np.flatnonzero(~mask_np[:, -1]).tolist()
        raise ValueError(
            f"rows {rows} end in padding: a prompt is left-padded (its last token must be a token)"
        )
    return mask_np


def _take_tokens(xp: Any, ids_BT: Tensor, index: np.ndarray) -> Tensor:
    """Columns ``index`` of ``ids_BT`` (a slice when they are consecutive)."""
    start, stop = int(index[0]), int(index[-1]) + 1
    if stop - start == len(index):
        return ids_BT[:, start:stop]
    return xp.take(ids_BT, index, 1)


def _check_lengths(lengths: Sequence[int], seq_len: int, cp: int) -> list[int]:
    lengths = [int(n) for n in lengths]
    if len(lengths) != cp or sum(lengths) != seq_len or min(lengths) < 1:
        raise ValueError(
            f"lengths={lengths} must give each of cp={cp} ranks at least one token and sum to T={seq_len}"
        )
    return lengths
