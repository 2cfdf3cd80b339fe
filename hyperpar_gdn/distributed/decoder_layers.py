"""The decoder layers of a model and their token mixers, for whichever model family, and the
adapter of this library's own decoder models.

A decoder model keeps its blocks in ``layers``; each block has a GDN mixer ``linear_attn`` or a
softmax-attention mixer ``self_attn``. Where the ``layers`` are is the model's adapter's to say
(:func:`~hyperpar_gdn.distributed.adapters.adapter_for`): :class:`DecoderAdapter` here for
``HybridLM`` (torch and MindSpore), :mod:`hyperpar_gdn.integrations.transformers.adapter` for
transformers' Qwen3.5 models.
A wrapper that hands out the model it wraps through ``get_base_model()`` (PEFT's
``PeftModel``) is looked through.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from hyperpar_gdn.distributed.adapters import ADAPTERS, ModelAdapter, register_adapter
from hyperpar_gdn.distributed.dtensor import as_sequence_shard
from hyperpar_gdn.distributed.layout import layout_mismatch
from hyperpar_gdn.distributed.mesh import DeviceMesh
from hyperpar_gdn.distributed.parallel_style import ParallelStyle, is_parallelized
from hyperpar_gdn.distributed.sequence import GlobalSequence, exchange_lengths
from hyperpar_gdn.distributed.softmax_attention import attention_forward, call_sequence
from hyperpar_gdn.ops.prefill_states import PrefillStates
from hyperpar_gdn.platform import Tensor

__all__ = [
    "DecoderAdapter",
    "adapter_for",
    "base_model_of",
    "find_decoder",
    "has_mixer",
    "is_silu",
    "layer_adapter_for",
    "mixer_of",
    "mixers_of",
    "module_adapter_for",
    "text_model_of",
]


def _first_serving(declines: Any) -> tuple[ModelAdapter | None, list[str]]:
    """The first registered adapter that ``declines(cls)`` does not refuse (None if every one does),
    and the reasons of those asked before it ("name: why")."""
    reasons = []
    for cls in ADAPTERS:
        why = declines(cls)
        if why is None:
            return cls(), reasons
        reasons.append(f"{cls.name}: {why}")
    return None, reasons


def adapter_for(model: Any) -> ModelAdapter:
    """The adapter serving ``model``; a ValueError naming each adapter's reason when none does."""
    adapter, reasons = _first_serving(lambda cls: cls.declines(model))
    if adapter is not None:
        return adapter
    raise ValueError(
        f"{type(model).__name__} has no decoder layers to parallelize: expected "
        f"{' or '.join(cls.models for cls in _ours_first())} ({'; '.join(reasons) or 'no adapter registered'})"
    )


def layer_adapter_for(module: Any) -> ModelAdapter:
    """The adapter serving the softmax-attention layer ``module``; a TypeError when none does."""
    adapter, reasons = _first_serving(lambda cls: cls.declines_layer(module))
    if adapter is not None:
        return adapter
    raise TypeError(
        f"{type(module).__name__}: SoftmaxAttentionContextParallel supports "
        f"{' and '.join(cls.attention_layers for cls in _ours_first())} "
        f"({'; '.join(reasons) or 'no adapter registered'})"
    )


def _ours_first() -> list[type[ModelAdapter]]:
    """The registered adapters, this library's own first (the order errors list them in)."""
    return sorted(ADAPTERS, key=lambda cls: cls is not DecoderAdapter)


def module_adapter_for(obj: Any) -> ModelAdapter:
    """The adapter of the family ``obj`` (a model or any module of one) belongs to: the first
    registered adapter that :meth:`~ModelAdapter.owns` it, else :class:`DecoderAdapter`."""
    for cls in ADAPTERS:
        if cls.owns(obj):
            return cls()
    return DecoderAdapter()


def is_silu(activation: Any) -> bool:
    """Whether the activation module ``activation`` is its family's SiLU."""
    return type(activation).__name__ in module_adapter_for(activation).silu_activations


def text_model_of(model: Any) -> Any:
    """The module holding the decoder ``layers`` of ``model`` (any model
    :func:`~hyperpar_gdn.apply_context_parallel` serves)."""
    return find_decoder(model)[1]


def base_model_of(model: Any) -> Any:
    """The model inside a wrapper that hands it out through ``get_base_model()`` (PEFT's
    ``PeftModel``, whose adapters sit inside that model's modules), else ``model``."""
    get_base_model = getattr(type(model), "get_base_model", None)
    return model.get_base_model() if callable(get_base_model) else model


def find_decoder(model: Any) -> tuple[Any, Any]:
    """(the multimodal model around it or None, the module holding the decoder ``layers``)."""
    model = base_model_of(model)
    return adapter_for(model).decoder(model)


def has_mixer(block: Any) -> bool:
    return getattr(block, "linear_attn", None) is not None or getattr(block, "self_attn", None) is not None


def mixer_of(index: int, block: Any) -> tuple[str, Any]:
    """(``"linear_attn"`` or ``"self_attn"``, the mixer module) of decoder block ``index``."""
    for kind in ("linear_attn", "self_attn"):
        module = getattr(block, kind, None)
        if module is not None:
            return kind, module
    raise ValueError(f"layer {index} ({type(block).__name__}) has neither linear_attn nor self_attn")


def mixers_of(text_model: Any) -> list[tuple[str, Any]]:
    """Every decoder block's (kind, mixer), in order."""
    return [mixer_of(i, block) for i, block in enumerate(text_model.layers)]


@register_adapter
class DecoderAdapter(ModelAdapter):
    """This library's decoder models (``HybridLM``, torch and MindSpore): ``layers`` on the model
    or its inner ``model``, a forward that takes ``cp_context=`` and hands it to every block, and
    attention layers with ``project()`` / ``finish()``
    (:class:`~hyperpar_gdn.models.attention.CausalSelfAttention`)."""

    name = "decoder"
    models = "HybridLM"
    attention_layers = "hyperpar_gdn.models.attention.CausalSelfAttention"

    @classmethod
    def declines(cls, model: Any) -> str | None:
        if "cp_context" not in _parameters(model):
            return "its forward takes no cp_context="
        if cls._holder(model) is None:
            return "no decoder layers with linear_attn or self_attn"
        return None

    @classmethod
    def declines_layer(cls, module: Any) -> str | None:
        missing = [name for name in ("project", "finish") if not callable(getattr(module, name, None))]
        return f"{type(module).__name__} has no {missing[0]}()" if missing else None

    @staticmethod
    def _holder(model: Any) -> Any:
        for candidate in (model, getattr(model, "model", None)):
            layers = getattr(candidate, "layers", None)
            if layers is not None and any(has_mixer(block) for block in layers):
                return candidate
        return None

    def decoder(self, model: Any) -> tuple[Any, Any]:
        return None, self._holder(model)

    def install_forward(self, model: Any, outer: Any, text_model: Any, mesh: Any, layout: str) -> None:
        ParallelStyle._install(model, lambda original: _per_forward(original, mesh, layout))

    def remove_forward(self, model: Any, text_model: Any) -> None:
        if is_parallelized(model):
            ParallelStyle.undo(model)

    def attention_forward(self, module: Any, mesh: Any, layout: str) -> Callable:
        adapter = _OwnAttention(module)

        def forward(
            hidden_states: Any,
            *,
            cu_seqlens: Any = None,
            prefill_states: PrefillStates | None = None,
            cp_context: GlobalSequence | None = None,
        ) -> Any:
            x_BTC, wrap = as_sequence_shard(hidden_states, owner=type(module).__name__, layout=layout)
            seq = call_sequence(
                mesh, layout, x_BTC, module.hidden_size, cp_context=cp_context, cu_seqlens=cu_seqlens
            )
            return wrap(attention_forward(adapter, mesh, x_BTC, seq, prefill_states=prefill_states))

        return forward

    def attention_heads(self, module: Any) -> tuple[int, int] | None:
        if not hasattr(module, "num_kv_heads"):
            return None
        return int(module.num_heads), int(module.num_kv_heads)

    def set_local_attention_heads(self, module: Any, heads: int, kv_heads: int) -> None:
        module.num_heads, module.num_kv_heads = heads, kv_heads

    def head_sharded_gdn_forward(self, module: Any) -> Callable | None:
        return None  # GatedDeltaNet's forward reads its weights through LayerWeights.of

    def keep_installed_forwards(self, model: Any) -> None:
        return None  # our modules keep the forward they are given


class _OwnAttention:
    """``CausalSelfAttention`` (either framework) as :func:`attention_forward` calls it."""

    def __init__(self, module: Any) -> None:
        self.module = module

    def project(self, x_BTC: Tensor, *, position_offset: int, cos_sin: Any = None) -> tuple[Tensor, ...]:
        return self.module.project(x_BTC, position_offset=position_offset)

    def finish(self, o_BTX: Tensor, gate_BTX: Tensor) -> Tensor:
        return self.module.finish(o_BTX, gate_BTX)


def _parameters(model: Any) -> Any:
    """The parameters of the model class's own forward (``construct`` for a MindSpore Cell), not of
    a forward installed on the instance (context parallelism's own wrapper)."""
    forward = getattr(type(model), "construct", None) or getattr(type(model), "forward", None)
    try:
        return inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return {}


def _per_forward(original: Any, mesh: DeviceMesh, layout: str) -> Any:
    """HybridLM's forward under context parallelism: it takes a ``cp_layout`` keyword (refused when
    it is not the model's) and describes the whole sequence once per forward for every mixer: one
    exchange of the shard lengths (every rank stops on any rank's bad input) and one host copy of
    ``cu_seqlens``, in a :class:`GlobalSequence` passed to the blocks as ``cp_context=`` (which
    then carries the documents: ``cu_seqlens`` goes on as None)."""
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
        bound.arguments["cu_seqlens"] = None
        bound.arguments["cp_context"] = GlobalSequence.build(
            lengths, rank=mesh.get_local_rank(), layout=layout, cu_seqlens=cu_seqlens
        )
        return original(*bound.args, **bound.kwargs)

    return forward
