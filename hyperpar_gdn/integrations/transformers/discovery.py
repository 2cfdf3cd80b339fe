"""Where transformers' Qwen3.5 models keep their decoder layers (causal LM, text model, multimodal)."""

from __future__ import annotations

from typing import Any

__all__ = ["TEXT_MODELS", "MULTIMODAL_MODELS", "CAUSAL_LMS", "find_text_model", "is_text_model"]

TEXT_MODELS = ("Qwen3_5TextModel", "Qwen3_5MoeTextModel")
MULTIMODAL_MODELS = ("Qwen3_5Model", "Qwen3_5MoeModel")
CAUSAL_LMS = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")


def is_text_model(module: Any) -> bool:
    return type(module).__name__ in TEXT_MODELS


def find_text_model(model: Any) -> tuple[Any, Any]:
    """(the multimodal model around it or None, the text model holding the decoder ``layers``)."""
    if type(model).__name__ in MULTIMODAL_MODELS:
        return model, model.language_model
    inner = getattr(model, "model", None)
    for candidate in (model, inner):
        if type(candidate).__name__ in TEXT_MODELS:
            return None, candidate
    if type(inner).__name__ in MULTIMODAL_MODELS:
        return inner, inner.language_model
    raise ValueError(
        f"{type(model).__name__} has no decoder layers to parallelize: expected transformers' "
        "Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM, their text models, or Qwen3_5(Moe)ForConditionalGeneration"
    )
