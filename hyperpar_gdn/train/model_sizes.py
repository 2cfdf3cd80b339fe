"""The built-in model's size presets (``--model-size``): hybrid GDN/softmax LMs from a quarter
million to a quarter billion parameters."""

from __future__ import annotations

from hyperpar_gdn.models.config import HybridLMConfig

__all__ = ["MODEL_SIZES"]

MODEL_SIZES: dict[str, HybridLMConfig] = {
    # ~0.25M parameters: the embedded default, under a minute on two CPU ranks.
    "tiny": HybridLMConfig(
        hidden_size=64,
        num_layers=4,
        intermediate_size=192,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=4,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    ),
    # ~6.9M parameters.
    "small": HybridLMConfig(
        hidden_size=256,
        num_layers=8,
        intermediate_size=768,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
    ),
    # ~0.27B parameters, Qwen3.5-like head sizes: for accelerators.
    "base": HybridLMConfig(
        hidden_size=1024,
        num_layers=16,
        intermediate_size=3072,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        linear_num_key_heads=8,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
    ),
}
