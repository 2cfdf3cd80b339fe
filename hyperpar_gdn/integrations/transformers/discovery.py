"""transformers' Qwen3.5 model classes by name, and where a multimodal one keeps its text model
(the causal LMs and text models keep their decoder layers where
:func:`hyperpar_gdn.distributed.decoder_layers.find_decoder` looks for any model's)."""

from __future__ import annotations

from typing import Any

__all__ = ["TEXT_MODELS", "MULTIMODAL_MODELS", "CAUSAL_LMS", "find_multimodal", "is_text_model"]

TEXT_MODELS = ("Qwen3_5TextModel", "Qwen3_5MoeTextModel")
MULTIMODAL_MODELS = ("Qwen3_5Model", "Qwen3_5MoeModel")
CAUSAL_LMS = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")


def is_text_model(module: Any) -> bool:
    return type(module).__name__ in TEXT_MODELS


def find_multimodal(model: Any) -> Any:
    """The multimodal Qwen3.5 model that is ``model`` or its inner ``model``, or None; its text
    model (``language_model``) holds the decoder layers."""
    for candidate in (model, getattr(model, "model", None)):
        if type(candidate).__name__ in MULTIMODAL_MODELS:
            return candidate
    return None
