"""The decoder layers of a model and their token mixers, for whichever model family.

A decoder model keeps its blocks in ``layers`` (on the model or its inner ``model``); each block
has a GDN mixer ``linear_attn`` or a softmax-attention mixer ``self_attn``. transformers'
multimodal Qwen3.5 models are found by :mod:`hyperpar_gdn.integrations.transformers.discovery`. A
wrapper that hands out the model it wraps through ``get_base_model()`` (PEFT's ``PeftModel``) is
looked through.
"""

from __future__ import annotations

from typing import Any

from hyperpar_gdn.distributed.parallel_style import from_transformers

__all__ = ["base_model_of", "find_decoder", "has_mixer", "mixer_of", "mixers_of", "text_model_of"]


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
    if from_transformers(model):
        from hyperpar_gdn.integrations.transformers.discovery import find_text_model

        return find_text_model(model)
    for candidate in (model, getattr(model, "model", None)):
        layers = getattr(candidate, "layers", None)
        if layers is not None and any(has_mixer(block) for block in layers):
            return None, candidate
    raise ValueError(
        f"{type(model).__name__} has no decoder layers to parallelize: expected HybridLM or transformers' "
        "Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM, their text models, or Qwen3_5(Moe)ForConditionalGeneration"
    )


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
