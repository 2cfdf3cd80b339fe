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
as the ``cp_context=`` keyword. The model's adapter (:mod:`.adapters`) says where its decoder
layers are and installs what builds that context once per forward: a wrapper of HybridLM's
forward (:class:`~.decoder_layers.DecoderAdapter`), forward pre-hooks on a transformers model
that also make its inputs right for a shard (:mod:`hyperpar_gdn.integrations.transformers.adapter`).
"""

from __future__ import annotations

import logging
from typing import Any

from hyperpar_gdn.distributed.agreement import agree_on_plan, first
from hyperpar_gdn.distributed.cp.ulysses_hidden import ulysses_hidden_error
from hyperpar_gdn.distributed.decoder_layers import (
    adapter_for,
    base_model_of,
    mixer_of,
    mixers_of,
    text_model_of,
)
from hyperpar_gdn.distributed.linear_attention_style import LinearAttentionContextParallel, layer_shape
from hyperpar_gdn.distributed.mesh import as_cp_mesh
from hyperpar_gdn.distributed.parallel_style import ParallelStyle, is_parallelized
from hyperpar_gdn.distributed.softmax_attention_style import SoftmaxAttentionContextParallel
from hyperpar_gdn.ops.gdn.layer import LayerDims
from hyperpar_gdn.planning.choice import choose_plan
from hyperpar_gdn.planning.plan import CPPlan, check_mode
from hyperpar_gdn.planning.ranking import machine_kind

__all__ = [
    "apply_context_parallel",
    "context_parallel_errors",
    "resolve_plan",
    "text_model_of",
    "undo_context_parallel",
]

logger = logging.getLogger(__name__)


# Long for its docstring: the public entry point documents every argument.
def apply_context_parallel(
    model: Any,
    mesh: Any,
    *,
    plan: CPPlan | None = None,
    mode: str | None = None,
    chunk_size: int = 64,
    layout: str = "contiguous",
    seq_len: int | None = None,
    inner_size: int | None = None,
    dtype: str = "bfloat16",
    kernel: str = "auto",
    devices_per_node: int | None = None,
) -> Any:
    """Make every decoder layer of ``model`` take and return a sequence shard along the 1-D ``mesh``.

    GDN mixers (``linear_attn``) get :class:`LinearAttentionContextParallel` with the ``plan``;
    softmax mixers (``self_attn``) get :class:`SoftmaxAttentionContextParallel` (all-gathered K and
    V, whatever the mode) in the plan's layout. Call it on every rank of the mesh: the ranks check
    the plan against every layer and the mesh, then compare their plans and layer shapes (one
    all-gather of an int), and only then change anything; a rank given another mode, layout, kernel
    or model stops every rank with one line naming the difference. Rank r of the mesh holds its
    tokens of every sequence in the plan's layout, as
    :func:`~hyperpar_gdn.shard_for_context_parallel` cuts them (contiguous: the r-th of cp pieces,
    usually ``[r*T/cp, (r+1)*T/cp)``, lengths may differ: each forward exchanges them; head_tail:
    pieces r and 2cp-1-r of 2*cp). Each rank passes only its own tokens: the whole sequence on every
    rank computes wrong results (a transformers model warns when every rank got the same tokens). On
    a transformers causal LM, ``labels=`` are this rank's shifted labels (``shard.labels``) and
    ``.loss`` is this rank's term of the global mean loss.

    Args:
        model: ``HybridLM``, or transformers' Qwen3.5 causal LM / text model / multimodal model, or
            any of them inside PEFT's ``PeftModel`` (its LoRA layers are called as the model holds
            them; a wrapper the layers would bypass is refused before any change).
        mesh: the CP axis (e.g. ``mesh["cp"]``).
        plan: a :class:`~hyperpar_gdn.CPPlan` (mode, layout, inner size, chunk size), or None to
            build one from the keywords below (give one or the other).
        mode: one of :data:`~hyperpar_gdn.planning.plan.MODE_CHOICES`: ``"ulysses"``,
            ``"ulysses_hidden"``, ``"p2p"``, ``"all_gather"``, ``"scan"``, the two-level
            ``"ulysses+p2p"``, ``"ulysses+all_gather"``, ``"ulysses+scan"`` (with ``inner_size``),
            or ``"auto"``: the plan :func:`~hyperpar_gdn.planning.choice.choose_plan` predicts
            fastest for this model, mesh, ``seq_len`` and ``dtype`` (logged, with why;
            docs/modes.md), two-level modes included when ``inner_size`` is given or the mesh spans
            nodes (of ``devices_per_node`` devices, else the device kind's usual number).
        chunk_size: chunk of the gated delta rule.
        layout: ``"contiguous"`` or ``"head_tail"`` (pieces r and 2cp-1-r of 2*cp: equal
            softmax-attention work on every rank). The model takes ``cp_layout=`` (a keyword of its
            forward, which ``ContextParallelBatch.model_inputs()`` passes) and refuses a batch cut
            for another.
        seq_len, dtype, devices_per_node: for ``mode="auto"`` only (``seq_len`` required there):
            what the cost model prices.
        inner_size: ranks per inner group (a node) of the two-level modes (and of ``"auto"``).
        kernel: the GDN layers' local kernel, ``"auto"``, ``"fla"`` or ``"native"`` (the plan's;
            :class:`LinearAttentionContextParallel`).

    Returns ``model``, changed in place; :func:`undo_context_parallel` restores it.
    """
    given = model
    model = base_model_of(model)  # a PeftModel: its hooks and forward go on the model it wraps
    plan = resolve_plan(
        model, mesh, plan=plan, mode=mode, chunk_size=chunk_size, layout=layout, seq_len=seq_len,
        inner_size=inner_size, dtype=dtype, kernel=kernel, devices_per_node=devices_per_node,
    )  # fmt: skip
    cp_mesh = as_cp_mesh(mesh)
    adapter = adapter_for(model)
    outer, text_model = adapter.decoder(model)
    mixers = mixers_of(text_model)
    linear_style = LinearAttentionContextParallel(plan=plan)
    errors = _errors(mixers, cp_mesh, linear_style)
    shapes = [(kind, layer_shape(m) if kind == "linear_attn" else ()) for kind, m in mixers]
    agree_on_plan(cp_mesh, plan, shapes, first(errors))
    linear_style.make_groups(cp_mesh)  # two levels: collective, before anything changes
    softmax_style = SoftmaxAttentionContextParallel(layout=plan.layout)
    done: list[Any] = []
    try:
        adapter.install_forward(model, outer, text_model, cp_mesh, plan.layout)
        for kind, module in mixers:
            style = linear_style if kind == "linear_attn" else softmax_style
            style.install(module, cp_mesh)
            done.append(module)
    except BaseException:  # leave the model as it was
        for module in done:
            ParallelStyle.undo(module)
        adapter.remove_forward(model, text_model)
        raise
    return given


def context_parallel_errors(model: Any, mesh: Any, plan: CPPlan, *, tp: int = 1) -> list[Exception]:
    """Every reason :func:`apply_context_parallel` would refuse ``plan`` on ``model`` over the 1-D
    ``mesh``, found on this rank alone: no communication, no change. ``tp``: the model's layers
    are to be split over ``tp`` ranks by tensor parallelism first (the checks see a TP rank's
    heads)."""
    model = base_model_of(model)
    _, text_model = adapter_for(model).decoder(model)
    return _errors(mixers_of(text_model), as_cp_mesh(mesh), LinearAttentionContextParallel(plan=plan), tp=tp)


def _errors(
    mixers: list[tuple[str, Any]], cp_mesh: Any, linear_style: LinearAttentionContextParallel, *, tp: int = 1
) -> list[Exception]:
    gdn = [(i, module) for i, (kind, module) in enumerate(mixers) if kind == "linear_attn"]
    errors = linear_style.errors(gdn, cp_mesh, tp=tp)
    attention = [
        i for i, (kind, module) in enumerate(mixers) if kind != "linear_attn" and is_parallelized(module)
    ]
    errors += [
        ValueError(f"layer {i} already has context parallelism applied; undo it first") for i in attention[:1]
    ]
    errors += [
        TypeError(f"layer {i}: {e}")
        for i, (kind, module) in enumerate(mixers)
        if kind != "linear_attn" and (e := SoftmaxAttentionContextParallel.error(module)) is not None
    ][:1]
    return errors


def resolve_plan(
    model: Any,
    mesh: Any,
    *,
    plan: CPPlan | None = None,
    mode: str | None = None,
    chunk_size: int = 64,
    layout: str = "contiguous",
    seq_len: int | None = None,
    inner_size: int | None = None,
    dtype: str = "bfloat16",
    kernel: str = "auto",
    devices_per_node: int | None = None,
    tp: int = 1,
) -> CPPlan:
    """The plan that :func:`apply_context_parallel`'s arguments ask for (the same checks on every
    rank): ``plan`` itself, or one built from the keywords; for ``mode="auto"`` the one place that
    turns auto into a plan: the model's GDN layer (as one of ``tp`` ranks holds it once tensor
    parallelism splits it), the CP mesh's ranks and device kind and ``devices_per_node`` handed to
    :func:`~hyperpar_gdn.planning.choice.choose_plan` (logged, with why)."""
    if plan is not None:
        if not isinstance(plan, CPPlan):
            raise TypeError(f"plan must be a CPPlan; got {type(plan).__name__}")
        given = {
            "mode": mode,
            "seq_len": seq_len,
            "inner_size": inner_size,
            "devices_per_node": devices_per_node,
        }
        extra = [k for k, v in given.items() if v is not None]
        extra += [
            k
            for k, v, d in (
                ("chunk_size", chunk_size, 64),
                ("layout", layout, "contiguous"),
                ("kernel", kernel, "auto"),
            )
            if v != d
        ]
        if extra:
            raise ValueError(f"give plan= or the keywords {', '.join(extra)}, not both")
        return plan
    if mode is None:
        raise ValueError("apply_context_parallel needs plan= or mode=")
    check_mode(mode, allow_auto=True)
    if (mode == "auto") != (seq_len is not None):
        raise ValueError(
            f"seq_len is given with mode='auto' and only then; got mode={mode!r}, seq_len={seq_len!r}"
        )
    if mode != "auto":
        if devices_per_node is not None:
            raise ValueError(f"devices_per_node is for mode='auto' only; got mode={mode!r}")
        return CPPlan(mode=mode, layout=layout, inner_size=inner_size, chunk_size=chunk_size, kernel=kernel)
    cp_mesh = as_cp_mesh(mesh)
    text_model = text_model_of(model)  # a PeftModel: the model it wraps
    gdn = [m for kind, m in mixers_of(text_model) if kind == "linear_attn"]
    if not gdn:
        raise ValueError(f"{type(model).__name__} has no GDN layers: there is no mode to choose")
    figures = {} if devices_per_node is None else {"devices_per_node": devices_per_node}
    # a mode the layers would refuse (ulysses_hidden over a wrapped projection) is not a choice
    refused = any(ulysses_hidden_error(m, "linear_attn") is not None for m in gdn)
    plan = choose_plan(
        LayerDims.of(gdn[0]).tp_rank(tp),  # every GDN layer of a model has the same shape
        ranks=list(cp_mesh.rank_list),
        device=machine_kind(cp_mesh.device_type),
        seq_len=seq_len,
        layout=layout,
        dtype=dtype,
        inner_size=inner_size,
        chunk_size=chunk_size,
        kernel=kernel,
        num_experts=int(getattr(getattr(text_model, "config", None), "num_experts", 0) or 0),
        leave_out=("ulysses_hidden",) if refused else (),
        **figures,
    )
    logger.info("apply_context_parallel(mode='auto'): %s", plan.reason)
    return plan


def undo_context_parallel(model: Any) -> Any:
    """Restore the single-device forward of every mixer of ``model`` (and remove its hooks)."""
    given = model
    model = base_model_of(model)
    adapter = adapter_for(model)
    _, text_model = adapter.decoder(model)
    for i, block in enumerate(text_model.layers):
        kind, module = mixer_of(i, block)
        style = LinearAttentionContextParallel if kind == "linear_attn" else SoftmaxAttentionContextParallel
        style.undo(module)
    adapter.remove_forward(model, text_model)
    return given
