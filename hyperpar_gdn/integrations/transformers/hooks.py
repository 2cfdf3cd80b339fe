"""The forward pre-hooks that put a transformers Qwen3.5 model's inputs right for a shard.

A transformers text model also gets a forward pre-hook that makes its inputs right for a shard
(docs/training.md, transformers models):

- ``position_ids`` default to the global positions of the shard's tokens (so RoPE is right);
- ``cp_layout`` (what :meth:`ContextParallelBatch.model_inputs` passes) must name the model's
  layout: a batch cut for another layout stops every rank;
- the shard lengths are exchanged and a 2-D ``attention_mask`` (this rank's shard of the padding
  mask) is gathered once per forward, into one :class:`GlobalSequence` added to the text model's
  keywords as ``cp_context``: its decoder layers pass their keywords on to both mixers (the
  softmax-attention layers need the keys of every rank, the GDN layers their own piece; the
  layers' ``attention_mask`` is None); packed
  documents (``position_ids`` that restart, or ``cu_seq_lens_q``) are read on the host once, here,
  and carried in it as host arrays, so no layer copies a device tensor to the host;
- ``use_cache`` defaults to False; a cache is refused.

transformers' hub kernels are off while the hooks are installed (:mod:`.hub_kernels`: a
re-kernelization at ``train()``/``eval()`` would drop the styles' forwards); removing the hooks
turns them on again.

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

from hyperpar_gdn.distributed.batch import IGNORE_INDEX
from hyperpar_gdn.distributed.layout import TokenLayout, layout_mismatch
from hyperpar_gdn.distributed.mesh import DeviceMesh
from hyperpar_gdn.distributed.parallel_style import refuse_unhandled
from hyperpar_gdn.distributed.sequence import GlobalSequence, exchange_lengths, gather_pieces
from hyperpar_gdn.integrations.transformers.hub_kernels import pause_hub_kernels, resume_hub_kernels
from hyperpar_gdn.ops.gdn.varlen import check_cu_seqlens

__all__ = ["install_hooks", "remove_hooks"]

_HOOKS = "_hyperpar_cp_hooks"
_PAUSED_KERNELS = "_hyperpar_paused_hub_kernels"  # the models whose hub kernels install_hooks turned off
_LOSS_KEYWORDS = ("shift_labels", "num_items_in_batch", "ignore_index")


def install_hooks(model: Any, outer: Any, text_model: Any, mesh: DeviceMesh, layout: str) -> None:
    """Install the hooks on a transformers text model (and its causal LM or multimodal model
    around it). Each forward passes its :class:`GlobalSequence` to the mixers as ``cp_context``."""
    _check_transformers_config(text_model.config)
    if getattr(text_model, _HOOKS, None) is not None:
        raise ValueError(f"{type(model).__name__} already has context parallelism applied; undo it first")
    # before the styles install their forwards, which a re-kernelization would drop
    setattr(text_model, _PAUSED_KERNELS, pause_hub_kernels(model))
    slot: dict[str, Any] = {}  # what the causal LM's hook hands to the inner models' hooks
    hooks = [
        text_model.register_forward_pre_hook(
            _text_model_hook(text_model, mesh, slot, layout), with_kwargs=True
        )
    ]
    if outer is not None:
        hooks.append(
            outer.register_forward_pre_hook(_multimodal_hook(outer, mesh, slot, layout), with_kwargs=True)
        )
    if model is not outer and model is not text_model and _takes_labels(model):
        hook = _causal_lm_hook(model, mesh, slot, layout, multimodal=outer is not None)
        hooks.append(model.register_forward_pre_hook(hook, with_kwargs=True))
    setattr(text_model, _HOOKS, hooks)


def remove_hooks(text_model: Any) -> bool:
    """Remove the hooks :func:`install_hooks` put on ``text_model``'s model; False if it had none."""
    if not hasattr(text_model, _HOOKS):
        return False
    for handle in getattr(text_model, _HOOKS) or ():
        handle.remove()
    delattr(text_model, _HOOKS)
    resume_hub_kernels(text_model.__dict__.pop(_PAUSED_KERNELS, []))
    return True


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
    error = error or local_error or layout_mismatch(arguments.pop("cp_layout", None), layout)
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
    carry a label). Sets ``arguments``' position_ids and removes the packed-document keywords: the
    :class:`GlobalSequence` carries the documents (host cu_seqlens) to every layer.

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
    on_host = by_rank  # the same reorder on the host: one copy to the host per forward, not two
    if not tokens_layout.is_contiguous:
        on_host = np.empty_like(by_rank)
        on_host[..., np.concatenate([tokens_layout.positions(r) for r in range(len(lengths))])] = by_rank
    padded = bool((on_host[1] == 0).any())  # the same choice on every rank
    cu = _packed_cu_seqlens(arguments, on_host[0], on_host[1] != 0)
    count = _labelled_tokens(by_rank[3], lengths) if count_labels else None
    # The mixers read the documents and the padding from this object (host arrays), not from
    # keywords: no layer copies a device tensor to the host.
    sequence = GlobalSequence.build(
        lengths,
        rank=mesh.get_local_rank(),
        layout=layout,
        key_mask=whole[1] if padded else None,
        host_key_mask=on_host[1] if padded else None,
        cu_seqlens=cu,
    )
    return sequence, count


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
        # Every mixer gets the same GlobalSequence (the decoder layers pass their keywords on): the
        # lengths are exchanged once per forward, not once per layer (on a GPU or NPU each exchange
        # is a host synchronisation); the GDN layers take their piece of the padding mask from it.
        # The layers' own masks are None (a dict per layer type: transformers builds none).
        arguments["cp_context"] = sequence
        arguments["attention_mask"] = dict.fromkeys(layer_types)
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
