"""Apply context parallelism to a whole decoder model: every token mixer takes a sequence shard.

Serves :class:`~hyperpar_gdn.models.HybridLM` (torch and MindSpore) and transformers' Qwen3.5
models: ``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``, their inner text models, and the
language model inside ``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5Model`` (text input only).
Everything else in these models (embedding, norms, MLPs and experts, LM head) works token by
token, so once the mixers take a sequence shard the whole model does: ``model(input_ids_local)``
returns this rank's logits ``[B, T/cp, V]``.

A transformers text model also gets a forward pre-hook that makes its inputs right for a shard
(docs/training.md, transformers models):

- ``position_ids`` default to the global positions of the shard's tokens (so RoPE is right);
- ``cp_layout`` (what :meth:`ContextParallelBatch.model_inputs` passes) must name the model's
  layout: a batch cut for another layout stops every rank;
- the shard lengths are exchanged and a 2-D ``attention_mask`` (this rank's shard of the padding
  mask) is gathered once per forward, into one :class:`GlobalSequence` that every mixer gets (the
  softmax-attention layers need the keys of every rank, the GDN layers their own piece);
- ``use_cache`` defaults to False; a cache is refused.

On a causal LM (``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``) a pre-hook builds that layout
once for the whole forward and hands it to the text model's hook; its ``labels`` are this rank's
shifted labels (``shard.labels``), passed to transformers' loss as ``shift_labels`` with
``num_items_in_batch`` = the labelled tokens of the whole CP group (counted in the same
all-gather), so each rank's ``.loss`` is its term of the global mean.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import numpy as np

from hyperpar_gdn.ops.attention import doc_ids_tensor
from hyperpar_gdn.ops.layer import LayerDims
from hyperpar_gdn.ops.varlen import check_cu_seqlens

from .attention_style import SoftmaxAttentionContextParallel
from .batch import IGNORE_INDEX
from .cp.ulysses import ulysses_head_error
from .layout import TokenLayout, check_layout
from .mesh import DeviceMesh, as_cp_mesh
from .sequence import GlobalSequence, exchange_lengths, gather_pieces
from .style import MODES, LinearAttentionContextParallel, ParallelStyle, refuse_unhandled

__all__ = ["apply_context_parallel", "text_model_of", "undo_context_parallel"]

TRANSFORMERS_TEXT_MODELS = ("Qwen3_5TextModel", "Qwen3_5MoeTextModel")
TRANSFORMERS_MULTIMODAL_MODELS = ("Qwen3_5Model", "Qwen3_5MoeModel")
_HOOKS = "_hyperpar_cp_hooks"
_LOSS_KEYWORDS = ("shift_labels", "num_items_in_batch", "ignore_index")


def apply_context_parallel(
    model: Any, mesh: Any, *, mode: str, chunk_size: int = 64, layout: str = "contiguous"
) -> Any:
    """Make every decoder layer of ``model`` take and return a sequence shard along the 1-D ``mesh``.

    GDN mixers (``linear_attn``) get :class:`LinearAttentionContextParallel` in ``mode``;
    softmax mixers (``self_attn``) get :class:`SoftmaxAttentionContextParallel` (all-gathered K
    and V, whatever ``mode``). Checks every layer before changing any. Rank r of the mesh holds
    its tokens of every sequence in ``layout``, as :func:`~hyperpar_gdn.shard_for_context_parallel`
    cuts them (contiguous: tokens ``[r*T/cp, (r+1)*T/cp)``, or pieces of different lengths, each
    forward exchanges the lengths; head_tail: pieces r and 2cp-1-r of 2*cp). Each rank passes only
    its own tokens: the whole sequence on every rank computes wrong results (a transformers model
    warns when every rank got the same tokens). On a transformers causal LM, ``labels=`` are this
    rank's shifted labels (``shard.labels``) and ``.loss`` is this rank's term of the global mean
    loss.

    Args:
        model: ``HybridLM``, or transformers' Qwen3.5 causal LM / text model / multimodal model.
        mesh: the CP axis (e.g. ``mesh["cp"]``).
        mode: ``"ulysses"``, ``"p2p"`` or ``"all_gather"`` for the GDN layers.
        chunk_size: chunk of the gated delta rule.
        layout: ``"contiguous"`` (rank r holds tokens ``[r*T/cp, (r+1)*T/cp)``) or ``"head_tail"``
            (pieces r and 2cp-1-r of 2*cp: equal softmax-attention work on every rank). The model
            takes ``cp_layout=`` (a keyword of its forward, which
            ``ContextParallelBatch.model_inputs()`` passes) and refuses a batch cut for another.

    Returns ``model``, changed in place; :func:`undo_context_parallel` restores it.
    """
    check_layout(layout)
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not a context-parallel mode; choose one of {', '.join(MODES)}")
    cp_mesh = as_cp_mesh(mesh)
    outer, text_model = _find_text_model(model)
    mixers = [_mixer(i, block) for i, block in enumerate(text_model.layers)]
    cp = cp_mesh.size()
    for i, (kind, module) in enumerate(mixers):
        error = (
            ulysses_head_error(LayerDims.of(module), cp)
            if mode == "ulysses" and kind == "linear_attn"
            else None
        )
        if error is not None:
            raise ValueError(f"layer {i}: {error}")
    if type(text_model).__name__ in TRANSFORMERS_TEXT_MODELS:
        _check_transformers_config(text_model.config)
        if getattr(text_model, _HOOKS, None) is not None:
            raise ValueError(f"{type(model).__name__} already has context parallelism applied; undo it first")
        slot: dict[str, Any] = {}  # what the causal LM's hook hands to the inner models' hooks
        hooks = [
            text_model.register_forward_pre_hook(
                _text_model_hook(text_model, cp_mesh, slot, layout), with_kwargs=True
            )
        ]
        if outer is not None:
            hooks.append(
                outer.register_forward_pre_hook(
                    _multimodal_hook(outer, cp_mesh, slot, layout), with_kwargs=True
                )
            )
        if model is not outer and model is not text_model and _takes_labels(model):
            hook = _causal_lm_hook(model, cp_mesh, slot, layout, multimodal=outer is not None)
            hooks.append(model.register_forward_pre_hook(hook, with_kwargs=True))
        setattr(text_model, _HOOKS, hooks)
    else:  # HybridLM: its forward takes cp_layout= and checks it
        ParallelStyle._install(model, lambda original: _checking_layout(original, layout))
    linear_style = LinearAttentionContextParallel(mode, chunk_size=chunk_size, layout=layout)
    softmax_style = SoftmaxAttentionContextParallel(layout=layout)
    for kind, module in mixers:
        (linear_style if kind == "linear_attn" else softmax_style).apply(module, cp_mesh)
    return model


def undo_context_parallel(model: Any) -> Any:
    """Restore the single-device forward of every mixer of ``model`` (and remove its hooks)."""
    _, text_model = _find_text_model(model)
    for i, block in enumerate(text_model.layers):
        kind, module = _mixer(i, block)
        style = LinearAttentionContextParallel if kind == "linear_attn" else SoftmaxAttentionContextParallel
        style.undo(module)
    for handle in getattr(text_model, _HOOKS, None) or ():
        handle.remove()
    if hasattr(text_model, _HOOKS):
        delattr(text_model, _HOOKS)
    else:
        ParallelStyle.undo(model)
    return model


def _layout_mismatch(given: Any, layout: str) -> str | None:
    """Why a batch that says it was cut in layout ``given`` cannot feed a model in ``layout``."""
    if given is None or given == layout:
        return None
    return (
        f"the batch was cut for cp_layout={given!r} but the model was parallelized with layout={layout!r}: "
        f"cut it with shard_for_context_parallel(..., layout={layout!r}) or apply context parallelism "
        f"with layout={given!r}"
    )


def _checking_layout(original: Any, layout: str) -> Any:
    """HybridLM's forward with a ``cp_layout`` keyword, refused when it is not the model's."""

    def forward(*args: Any, cp_layout: str | None = None, **kwargs: Any) -> Any:
        error = _layout_mismatch(cp_layout, layout)
        if error is not None:
            raise ValueError(error)
        return original(*args, **kwargs)

    return forward


def text_model_of(model: Any) -> Any:
    """The module holding the decoder ``layers`` of ``model`` (any model
    :func:`apply_context_parallel` serves)."""
    return _find_text_model(model)[1]


def _find_text_model(model: Any) -> tuple[Any, Any]:
    """(the multimodal model around it or None, the module holding the decoder ``layers``)."""
    if type(model).__name__ in TRANSFORMERS_MULTIMODAL_MODELS:
        return model, model.language_model
    inner = getattr(model, "model", None)
    for candidate in (model, inner):
        layers = getattr(candidate, "layers", None)
        if layers is not None and any(_has_mixer(block) for block in layers):
            return None, candidate
    if type(inner).__name__ in TRANSFORMERS_MULTIMODAL_MODELS:
        return inner, inner.language_model
    raise ValueError(
        f"{type(model).__name__} has no decoder layers to parallelize: expected HybridLM or transformers' "
        "Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM, their text models, or Qwen3_5(Moe)ForConditionalGeneration"
    )


def _has_mixer(block: Any) -> bool:
    return getattr(block, "linear_attn", None) is not None or getattr(block, "self_attn", None) is not None


def _mixer(index: int, block: Any) -> tuple[str, Any]:
    for kind in ("linear_attn", "self_attn"):
        module = getattr(block, kind, None)
        if module is not None:
            return kind, module
    raise ValueError(f"layer {index} ({type(block).__name__}) has neither linear_attn nor self_attn")


def _check_transformers_config(config: Any) -> None:
    kinds = set(config.layer_types)
    if not kinds <= {"linear_attention", "full_attention"}:
        raise NotImplementedError(
            f"layer types {sorted(kinds)}: context parallelism serves linear_attention and full_attention"
        )


def _bind(module: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    arguments = dict(inspect.signature(module.forward).bind(*args, **kwargs).arguments)
    arguments.update(arguments.pop("kwargs", {}))
    return arguments


def _local_input(module: Any, arguments: dict[str, Any]) -> tuple[Any, str | None]:
    """This rank's input tensor and what is wrong with its call (None if nothing); the cache is
    refused and use_cache turned off."""
    name = type(module).__name__
    if arguments.get("use_cache"):
        raise NotImplementedError(f"{name}: use_cache=True is not supported under context parallelism")
    arguments["use_cache"] = False
    refuse_unhandled(name, {k: arguments.get(k) for k in ("cache", "past_key_values")})
    x = arguments.get("input_ids")
    if x is None:
        x = arguments.get("inputs_embeds")
    if x is None or x.dim() < 2:
        return x, f"{name} under context parallelism needs input_ids [B, T/cp] or inputs_embeds [B, T/cp, C]"
    shape = tuple(x.shape[:2])
    for key in ("attention_mask", "position_ids"):
        value = arguments.get(key)
        if isinstance(value, dict) or (value is not None and tuple(value.shape) != shape):
            got = type(value).__name__ if isinstance(value, dict) else f"shape {tuple(value.shape)}"
            return (
                x,
                f"{name} under context parallelism takes {key} as this rank's shard [B, T/cp] = {shape}; got {got}",
            )
    return x, None


def _layout(
    module: Any, mesh: DeviceMesh, arguments: dict[str, Any], layout: str, error: str | None = None
) -> tuple[TokenLayout, Any]:
    """Exchange the piece lengths (every rank stops on any rank's bad input, a batch cut for
    another layout included, or on ``error``, a problem a hook found before) and fill in the global
    position_ids when none are given. Returns (the token layout, position_ids [B, T_r])."""
    x, local_error = _local_input(module, arguments)
    error = error or local_error or _layout_mismatch(arguments.pop("cp_layout", None), layout)
    lengths = exchange_lengths(mesh, None if error else x.shape[1], error)
    tokens = TokenLayout.of(layout, lengths)  # the same lengths, so the same error, on every rank
    positions = arguments.get("position_ids")
    if positions is None:
        b, t = x.shape[0], x.shape[1]
        positions = mesh.platform.ops.constant(tokens.positions(mesh.get_local_rank()), like=x)
        positions = positions.reshape(1, t).expand(b, t)
        arguments["position_ids"] = positions
    return tokens, positions


def _global_sequence(
    module: Any,
    mesh: DeviceMesh,
    arguments: dict[str, Any],
    *,
    layout: str,
    error: str | None = None,
    count_labels: bool = False,
) -> tuple[GlobalSequence, int | None]:
    """Everything a forward's mixers need about the whole sequence, from one length exchange and
    one small all-gather (positions, padding, tokens and, with ``count_labels``, which positions
    carry a label). Sets ``arguments``' position_ids and packed-document keywords for the layers.

    Returns the :class:`GlobalSequence` and, with ``count_labels``, the labelled tokens of the
    whole CP group (None when no rank passed labels)."""
    tokens_layout, positions = _layout(module, mesh, arguments, layout, error)
    lengths = tokens_layout.lengths
    mask = arguments.get("attention_mask")
    xp = mesh.platform.ops
    ones = positions * 0 + 1
    tokens = arguments.get("input_ids")
    channels = [
        positions,
        ones if mask is None else xp.cast(mask != 0, positions.dtype),
        -ones if tokens is None else xp.cast(tokens, positions.dtype),
    ]
    if count_labels:
        labels = arguments.get("labels")
        ignore = arguments.get("ignore_index", IGNORE_INDEX)
        channels.append(-ones if labels is None else xp.cast(labels != ignore, positions.dtype))
    local = xp.stack(channels, 0)
    whole = gather_pieces(mesh, local, lengths, 2) if mesh.size() > 1 else local  # [channels, B, T]
    by_rank = xp.to_numpy(whole)  # the ranks' pieces one after the other
    _warn_if_whole_sequence_everywhere(by_rank, lengths)
    whole = tokens_layout.to_global(xp, whole, 2)  # global order (head_tail: pieces reordered)
    on_host = by_rank if tokens_layout.is_contiguous else xp.to_numpy(whole)
    key_mask = whole[1] if bool((on_host[1] == 0).any()) else None  # the same choice on every rank
    cu = _packed_cu_seqlens(arguments, on_host[0], on_host[1] != 0)
    doc_ids = None
    if cu is not None:
        doc_ids = doc_ids_tensor(xp, cu, seq_len=sum(lengths), like=positions)
        arguments["cu_seq_lens_q"] = xp.constant(cu, like=positions)  # for the GDN layers
    count = _labelled_tokens(by_rank[3], lengths) if count_labels else None
    return GlobalSequence(lengths, key_mask=key_mask, doc_ids=doc_ids, layout=layout), count


def _labelled_tokens(labelled: np.ndarray, lengths: tuple[int, ...]) -> int | None:
    """The labelled tokens of the whole sequence (``labelled`` [B, T]: 1 labelled, 0 not, -1 on
    the pieces of ranks that passed no labels); None when no rank passed labels."""
    starts = np.cumsum((0,) + tuple(lengths))
    without = [r for r in range(len(lengths)) if (labelled[:, starts[r] : starts[r + 1]] < 0).any()]
    if len(without) == len(lengths):
        return None
    if without:
        raise ValueError(
            f"labels= was passed on some CP ranks but not on ranks {without}: pass every rank its "
            "shard's labels (shard.labels), or none"
        )
    return int(labelled.sum())


def _warn_if_whole_sequence_everywhere(on_host: np.ndarray, lengths: tuple[int, ...]) -> None:
    """Warn when every rank holds the same piece (the same tokens, or without input_ids the same
    positions): the mark of the whole sequence given to every rank instead of its shard, which
    computes wrong results without any error."""
    if len(lengths) < 2 or len(set(lengths)) != 1:
        return
    t = lengths[0]
    channel = 2 if (on_host[2] >= 0).all() else 0  # the tokens if every rank passed input_ids
    pieces = [on_host[channel][:, r * t : (r + 1) * t] for r in range(len(lengths))]
    if all(np.array_equal(pieces[0], piece) for piece in pieces[1:]):
        warnings.warn(
            f"every one of the {len(lengths)} CP ranks got the same {t} tokens"
            + ("" if channel == 2 else " (the same position_ids)")
            + ": under context parallelism each rank takes its own piece of the sequence "
            "(shard_for_context_parallel(mesh, input_ids, ...)); the whole sequence on every rank "
            "computes wrong results",
            stacklevel=2,
        )


def _text_model_hook(text_model: Any, mesh: DeviceMesh, slot: dict[str, Any], layout: str) -> Any:
    layer_types = set(text_model.config.layer_types)

    def hook(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        arguments = _bind(module, args, kwargs)
        sequence = slot.pop("sequence", None)
        if sequence is None:  # called directly, not through the causal LM
            sequence, _ = _global_sequence(
                module, mesh, arguments, layout=layout, error=slot.pop("error", None)
            )
        else:  # the causal LM's hook built it; the loss keywords are for its loss, not the layers
            for key in _LOSS_KEYWORDS:
                arguments.pop(key, None)
        # Every mixer gets the same GlobalSequence: the lengths are exchanged once per forward,
        # not once per layer (on a GPU or NPU each exchange is a host synchronisation); the GDN
        # layers take their piece of the padding mask from it.
        per_type: dict[str, Any] = dict.fromkeys(layer_types)
        per_type["full_attention"] = per_type["linear_attention"] = sequence
        arguments["attention_mask"] = per_type
        return (), arguments

    return hook


def _takes_labels(model: Any) -> bool:
    """A transformers model that computes its loss from ``labels``."""
    forward = getattr(model, "forward", None)
    return (
        forward is not None
        and hasattr(model, "loss_function")
        and "labels" in inspect.signature(forward).parameters
    )


def _causal_lm_hook(
    model: Any, mesh: DeviceMesh, slot: dict[str, Any], layout: str, *, multimodal: bool
) -> Any:
    """On the causal LM: ``labels`` are this rank's shifted labels (``shard.labels``), passed on
    as transformers' ``shift_labels`` with ``num_items_in_batch`` = the labelled tokens of the whole
    CP group, so that each rank's ``.loss`` is its term of the global mean (the terms add up to the
    single-device loss, their gradients summed to its gradient). The whole sequence's layout is
    built here, once, for the text model's hook."""
    config = model.config

    def hook(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        slot.clear()
        arguments = _bind(module, args, kwargs)
        error = _loss_error(module, config, arguments)
        labels = arguments.get("labels")
        if multimodal:
            if error is None and labels is not None:
                error = (
                    f"{type(module).__name__} under context parallelism does not handle labels=; compute "
                    "the loss with context_parallel_loss(output.logits, shard.labels, mesh)"
                )
            slot["error"] = error  # raised on every rank by the next length exchange
            return (), arguments
        sequence, count = _global_sequence(
            module, mesh, arguments, layout=layout, error=error, count_labels=True
        )
        slot["sequence"] = sequence
        if labels is not None:
            # already shifted on the whole sequence; transformers' loss flattens it with view()
            arguments["shift_labels"] = labels.contiguous()  # a transformers model: torch
            arguments["num_items_in_batch"] = count
        return (), arguments

    return hook


def _loss_error(module: Any, config: Any, arguments: dict[str, Any]) -> str | None:
    """What the causal LM's loss cannot do under context parallelism with these arguments."""
    name = type(module).__name__
    labels, shift_labels = arguments.get("labels"), arguments.get("shift_labels")
    x = arguments.get("input_ids")
    if x is None:
        x = arguments.get("inputs_embeds")
    keep = arguments.get("logits_to_keep", 0)
    if not isinstance(keep, int) or keep != 0:
        return (
            f"{name} under context parallelism does not handle logits_to_keep={keep!r} (it would keep the "
            "last tokens of every rank's shard); take the last rank's last logits instead"
        )
    if arguments.get("num_items_in_batch") is not None:
        return (
            f"{name} under context parallelism does not take num_items_in_batch=: it divides by the "
            "labelled tokens of the whole CP group itself; for another normalisation sum the token "
            "losses yourself (see context_parallel_loss)"
        )
    router = arguments.get("output_router_logits")
    if router or (router is None and getattr(config, "output_router_logits", False)):
        return (
            f"{name} under context parallelism does not handle output_router_logits=True (the "
            "load-balancing loss would see one rank's tokens only)"
        )
    if shift_labels is not None and (labels is None or not _same(labels, shift_labels)):
        return (
            f"{name} under context parallelism takes labels= as this rank's labels, already shifted "
            "(shard.labels), and sets shift_labels= from them: pass labels only"
        )
    if labels is not None and x is not None and tuple(labels.shape) != tuple(x.shape[:2]):
        return (
            f"{name} under context parallelism takes labels as this rank's shard [B, T/cp] = "
            f"{tuple(x.shape[:2])} (shard.labels); got shape {tuple(labels.shape)}"
        )
    return None


def _same(a: Any, b: Any) -> bool:
    return tuple(a.shape) == tuple(b.shape) and bool((a == b).all())


def _packed_cu_seqlens(arguments: dict[str, Any], positions: Any, real: Any) -> np.ndarray | None:
    """The global cu_seqlens of packed documents, or None: from transformers' ``cu_seq_lens_q``
    (global, the same on every rank) or from position_ids that restart (a new document wherever
    a position is not its predecessor + 1, as transformers detects packing; padding, ``real``
    False, is not a restart: left-padded prompts have positions 0 there). Both must agree;
    ``cu_seq_lens_k`` and ``max_length_q/k``, if given, must match."""
    b, t = positions.shape
    steps = (np.diff(positions, axis=1) != 1) & real[:, 1:] & real[:, :-1]
    restarts = np.flatnonzero(steps.any(axis=0)) + 1
    given = arguments.pop("cu_seq_lens_q", None)
    from_positions = None
    if len(restarts):
        if b != 1:
            raise NotImplementedError(
                f"packed documents (position_ids that restart) need batch size B=1; got B={b}"
            )
        from_positions = np.concatenate([[0], restarts, [t]])
    cu = from_positions
    if given is not None:
        cu = check_cu_seqlens(given, seq_len=t, batch_size=b)
        if from_positions is not None and not np.array_equal(cu, from_positions):
            raise ValueError(
                f"cu_seq_lens_q {cu.tolist()} and the documents of position_ids {from_positions.tolist()} differ"
            )
    for key in ("cu_seq_lens_k", "max_length_q", "max_length_k"):
        value = arguments.pop(key, None)
        if value is None:
            continue
        expected = cu if key == "cu_seq_lens_k" else (None if cu is None else int(np.diff(cu).max()))
        got = check_cu_seqlens(value, seq_len=t) if key == "cu_seq_lens_k" else int(value)
        if expected is None or not np.array_equal(got, expected):
            raise ValueError(
                f"{key}={got!r} does not match the packed documents {None if cu is None else cu.tolist()}"
            )
    return cu


def _multimodal_hook(outer: Any, mesh: DeviceMesh, slot: dict[str, Any], layout: str) -> Any:
    """On a multimodal Qwen3.5 model: text only; global positions instead of its local 3-D ones."""

    def hook(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        arguments = _bind(module, args, kwargs)
        media = {k: arguments.get(k) for k in ("pixel_values", "pixel_values_videos", "mm_encoder_outputs")}
        refuse_unhandled(type(module).__name__ + " (images and videos)", media)
        _layout(module, mesh, arguments, layout, slot.pop("error", None))
        return (), arguments

    return hook
