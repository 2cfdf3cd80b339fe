"""What the trainer and the scripts ask of a ``--model`` directory's ``config.json`` (the GDN
sizes, the position range, whether it has softmax attention), without transformers or torch (the
memory plan reads them before the framework is imported). The file is read by the one reader,
:func:`hyperpar_gdn.models.qwen35_config.read_config`; re-exported by :mod:`.model_dir`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hyperpar_gdn.models.qwen35_config import MODEL_TYPES as TEXT_MODEL_TYPES
from hyperpar_gdn.models.qwen35_config import read_config as _read_config

__all__ = [
    "TEXT_MODEL_TYPES",
    "gdn_dims",
    "has_softmax_attention",
    "position_range",
    "read_config",
    "text_config",
]


def _text_config(path: str | Path) -> dict[str, Any]:
    """The text part of ``path/config.json`` (checked), without importing transformers."""
    config = read_config(path)
    return config.get("text_config", config)


def read_config(path: str | Path) -> dict[str, Any]:
    """``path/config.json`` of a Qwen3.5 model directory (checked: it exists, is JSON, names a
    Qwen3.5 model type), multimodal ones whole: :func:`~hyperpar_gdn.models.qwen35_config.read_config`
    with errors that name ``--model``."""
    return _read_config(path, option="--model")


def text_config(path: str | Path) -> dict[str, Any]:
    """The text part of a model directory's config.json (checked; transformers is not imported)."""
    return _text_config(path)


def gdn_dims(path: str | Path) -> tuple[int, int, int]:
    """(linear_num_key_heads, linear_num_value_heads, linear_conv_kernel_dim) of a model directory."""
    text = _text_config(path)
    return (
        int(text["linear_num_key_heads"]),
        int(text["linear_num_value_heads"]),
        int(text["linear_conv_kernel_dim"]),
    )


def position_range(path: str | Path) -> int | None:
    """``max_position_embeddings`` of a model directory (None when its config.json has none)."""
    limit = _text_config(path).get("max_position_embeddings")
    return None if limit is None else int(limit)


def has_softmax_attention(path: str | Path) -> bool:
    """Whether a model directory's decoder has softmax-attention (``full_attention``) layers."""
    text = _text_config(path)
    if "layer_types" in text:
        return "full_attention" in text["layer_types"]
    interval, layers = text.get("full_attention_interval", 4), int(text["num_hidden_layers"])
    return layers >= interval  # transformers' default: every interval-th layer
