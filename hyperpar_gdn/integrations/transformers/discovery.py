"""Where transformers' Qwen3.5 models keep their decoder layers (causal LM, text model, multimodal)."""

from __future__ import annotations

from typing import Any

__all__ = [
    "ATTENTION_LAYERS",
    "CAUSAL_LMS",
    "MULTIMODAL_MODELS",
    "TEXT_MODELS",
    "find_text_model",
    "from_transformers",
    "is_qwen35",
]

TEXT_MODELS = ("Qwen3_5TextModel", "Qwen3_5MoeTextModel")
MULTIMODAL_MODELS = ("Qwen3_5Model", "Qwen3_5MoeModel")
CAUSAL_LMS = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")
ATTENTION_LAYERS = ("Qwen3_5Attention", "Qwen3_5MoeAttention")


def from_transformers(obj: Any) -> bool:
    """Whether ``obj`` is an instance of a transformers class (a model or any of its modules)."""
    return type(obj).__module__.split(".", 1)[0] == "transformers"


def is_qwen35(model: Any) -> bool:
    """A Qwen3.5 text or multimodal model, or a model holding one as its ``model``."""
    holders = TEXT_MODELS + MULTIMODAL_MODELS
    return any(type(m).__name__ in holders for m in (model, getattr(model, "model", None)))


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
