"""Apply context parallelism to a whole decoder model: every token mixer takes a sequence shard.

Serves :class:`~hyperpar_gdn.models.HybridLM` (torch and MindSpore) and transformers' Qwen3.5
models: ``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``, their inner text models, and the
language model inside ``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5Model`` (text input only).
Everything else in these models (embedding, norms, MLPs and experts, LM head) works token by
token, so once the mixers take a sequence shard the whole model does: ``model(input_ids_local)``
returns this rank's logits ``[B, T/cp, V]``.

Per forward, the whole sequence is described once on the host (the shard lengths, the padding,
the packed documents' boundaries: a :class:`~hyperpar_gdn.distributed.sequence.GlobalSequence`)
and carried to every mixer, so no layer exchanges lengths or copies a device tensor to the host:
HybridLM's forward is wrapped to build it (and passes it to its blocks as their ``cu_seqlens``); a
transformers model gets forward pre-hooks that build it and make its inputs right for a shard
(:mod:`hyperpar_gdn.integrations.transformers.hooks`).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from hyperpar_gdn.distributed.cp.two_level import TWO_LEVEL_MODES
from hyperpar_gdn.distributed.cp.ulysses import HEAD_MODES, ulysses_head_error
from hyperpar_gdn.distributed.decoder_layers import find_decoder, mixer_of, text_model_of
from hyperpar_gdn.distributed.layout import check_layout, layout_mismatch
from hyperpar_gdn.distributed.linear_attention_style import MODES, LinearAttentionContextParallel
from hyperpar_gdn.distributed.mesh import DeviceMesh, as_cp_mesh
from hyperpar_gdn.distributed.parallel_style import ParallelStyle, from_transformers
from hyperpar_gdn.distributed.planner import plan_for_model
from hyperpar_gdn.distributed.sequence import GlobalSequence, exchange_lengths
from hyperpar_gdn.distributed.softmax_attention_style import SoftmaxAttentionContextParallel
from hyperpar_gdn.ops.gdn.layer import LayerDims

__all__ = ["apply_context_parallel", "text_model_of", "undo_context_parallel"]

logger = logging.getLogger(__name__)


# Long for its docstring (32 of its 86 lines): the public entry point documents every argument.
def apply_context_parallel(
    model: Any,
    mesh: Any,
    *,
    mode: str,
    chunk_size: int = 64,
    layout: str = "contiguous",
    seq_len: int | None = None,
    inner_size: int | None = None,
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
        mode: ``"ulysses"``, ``"ulysses_hidden"``, ``"p2p"``, ``"all_gather"`` or ``"scan"`` for
            the GDN layers, or
            ``"auto"``: the one :func:`~hyperpar_gdn.plan_context_parallel` predicts fastest for
            this model, mesh and ``seq_len`` (logged, with why; docs/modes.md), two-level modes
            included when ``inner_size`` is given or the mesh spans nodes.
        chunk_size: chunk of the gated delta rule.
        layout: ``"contiguous"`` (rank r holds tokens ``[r*T/cp, (r+1)*T/cp)``) or ``"head_tail"``
            (pieces r and 2cp-1-r of 2*cp: equal softmax-attention work on every rank). The model
            takes ``cp_layout=`` (a keyword of its forward, which
            ``ContextParallelBatch.model_inputs()`` passes) and refuses a batch cut for another.
        seq_len: the whole sequence's tokens, for ``mode="auto"`` only (required there).
        inner_size: for the two-level GDN modes (``"ulysses+p2p"``, ``"ulysses+all_gather"``,
            ``"ulysses+scan"``) and ``"auto"`` only: ranks per inner group (a node); the softmax
            layers use the whole group.

    Returns ``model``, changed in place; :func:`undo_context_parallel` restores it.
    """
    check_layout(layout)
    if mode not in (*MODES, *TWO_LEVEL_MODES, "auto"):
        raise ValueError(
            f"mode={mode!r} is not a context-parallel mode; choose one of "
            f"{', '.join((*MODES, *TWO_LEVEL_MODES))} or auto"
        )
    if (mode == "auto") != (seq_len is not None):
        raise ValueError(
            f"seq_len is given with mode='auto' and only then; got mode={mode!r}, seq_len={seq_len!r}"
        )
    if mode == "auto":
        plan = plan_for_model(model, mesh, seq_len=seq_len, layout=layout, inner_size=inner_size)
        logger.info("apply_context_parallel(mode='auto'): %s", plan.why())
        mode, inner_size = plan.choice, plan.inner_size
    cp_mesh = as_cp_mesh(mesh)
    outer, text_model = find_decoder(model)
    mixers = [mixer_of(i, block) for i, block in enumerate(text_model.layers)]
    cp = cp_mesh.size()
    linear_style = LinearAttentionContextParallel(
        mode, chunk_size=chunk_size, layout=layout, inner_size=inner_size
    )
    heads_over = cp if mode in HEAD_MODES else inner_size  # ranks ulysses splits the heads over
    if inner_size is not None and cp % inner_size:
        raise ValueError(f"mode={mode!r}: inner_size={inner_size} does not divide cp={cp}")
    for i, (kind, module) in enumerate(mixers):
        error = (
            ulysses_head_error(LayerDims.of(module), heads_over, mode if mode in HEAD_MODES else "ulysses")
            if heads_over is not None and kind == "linear_attn"
            else None
        )
        if error is not None:
            raise ValueError(f"layer {i}: {error}")
    if from_transformers(text_model):
        from hyperpar_gdn.integrations.transformers.hooks import install_hooks

        installed = install_hooks(model, outer, text_model, cp_mesh, layout)
    else:
        installed = False
    if not installed:  # HybridLM: its forward takes cp_layout= and checks it
        ParallelStyle._install(model, lambda original: _per_forward(original, cp_mesh, layout))
    softmax_style = SoftmaxAttentionContextParallel(layout=layout)
    for kind, module in mixers:
        (linear_style if kind == "linear_attn" else softmax_style).apply(module, cp_mesh)
    return model


def undo_context_parallel(model: Any) -> Any:
    """Restore the single-device forward of every mixer of ``model`` (and remove its hooks)."""
    _, text_model = find_decoder(model)
    for i, block in enumerate(text_model.layers):
        kind, module = mixer_of(i, block)
        style = LinearAttentionContextParallel if kind == "linear_attn" else SoftmaxAttentionContextParallel
        style.undo(module)
    removed = False
    if from_transformers(text_model):
        from hyperpar_gdn.integrations.transformers.hooks import remove_hooks

        removed = remove_hooks(text_model)
    if not removed:
        ParallelStyle.undo(model)
    return model


def _per_forward(original: Any, mesh: DeviceMesh, layout: str) -> Any:
    """HybridLM's forward under context parallelism: it takes a ``cp_layout`` keyword (refused when
    it is not the model's) and describes the whole sequence once per forward for every mixer: one
    exchange of the shard lengths (every rank stops on any rank's bad input) and one host copy of
    ``cu_seqlens``, in a :class:`GlobalSequence` passed to the blocks as their ``cu_seqlens``."""
    signature = inspect.signature(original)

    def forward(*args: Any, cp_layout: str | None = None, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        input_ids, cu_seqlens = bound.arguments.get("input_ids"), bound.arguments.get("cu_seqlens")
        error = layout_mismatch(cp_layout, layout)
        if error is None and (input_ids is None or len(input_ids.shape) != 2):
            error = f"input_ids must be this rank's shard [B, T/cp]; got {None if input_ids is None else tuple(input_ids.shape)}"
        if error is None and cu_seqlens is not None and input_ids.shape[0] != 1:
            error = f"packed documents (cu_seqlens) need batch size B=1; got B={input_ids.shape[0]}"
        lengths = exchange_lengths(mesh, None if error else input_ids.shape[1], error)
        bound.arguments["cu_seqlens"] = GlobalSequence.build(lengths, layout=layout, cu_seqlens=cu_seqlens)
        return original(*bound.args, **bound.kwargs)

    return forward
