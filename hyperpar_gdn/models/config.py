"""The sizes of the hybrid LM (:class:`HybridLMConfig`) and its block kinds, framework-free: the
torch :class:`hyperpar_gdn.models.lm.HybridLM` and the MindSpore
:class:`hyperpar_gdn.models.mindspore.HybridLM` are both built from it, and importing it loads
neither framework."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from hyperpar_gdn.models.block_config import DecoderSizes

__all__ = ["FULL", "LINEAR", "HybridLMConfig", "check_layer_type"]

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(kw_only=True, frozen=True)
class HybridLMConfig(DecoderSizes):
    """Sizes of :class:`HybridLM`.

    Attributes:
        vocab_size: tokens (256 for bytes).
        hidden_size: model width C.
        num_layers: blocks.
        full_attention_interval: every this-many-th block (the 4th, 8th, ...) uses softmax
            attention, the others Gated DeltaNet; Qwen3.5 uses 4.
        intermediate_size: width of the SwiGLU MLP.
        num_attention_heads, num_key_value_heads, head_dim: the softmax attention layers.
        linear_num_key_heads, linear_num_value_heads, linear_key_head_dim, linear_value_head_dim,
            linear_conv_kernel_dim: the Gated DeltaNet layers.
        rope_theta: RoPE base of the softmax attention.
        rms_norm_eps: epsilon of every RMSNorm.
        initializer_range: std of the normal init of linear and embedding weights.
    """

    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 4
    full_attention_interval: int = 4
    intermediate_size: int = 192
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 16
    linear_value_head_dim: int = 16
    linear_conv_kernel_dim: int = 4
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        positive = (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "full_attention_interval",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "linear_num_key_heads",
            "linear_num_value_heads",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_conv_kernel_dim",
        )
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"HybridLMConfig.{name} must be a positive int; got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"HybridLMConfig.num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"HybridLMConfig.linear_num_value_heads={self.linear_num_value_heads} must be a multiple "
                f"of linear_num_key_heads={self.linear_num_key_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"HybridLMConfig.head_dim={self.head_dim} must be even (RoPE)")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0 or self.initializer_range <= 0:
            raise ValueError(
                f"HybridLMConfig.rope_theta={self.rope_theta}, rms_norm_eps={self.rms_norm_eps} and "
                f"initializer_range={self.initializer_range} must be positive"
            )

    @property
    def layer_types(self) -> tuple[str, ...]:
        """``"linear_attention"`` or ``"full_attention"`` per block (as transformers names them)."""
        n = self.full_attention_interval
        return tuple(FULL if (i + 1) % n == 0 else LINEAR for i in range(self.num_layers))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def check_layer_type(layer_type: str) -> str:
    if layer_type not in (LINEAR, FULL):
        raise ValueError(f"layer_type={layer_type!r} is not {LINEAR!r} or {FULL!r}")
    return layer_type
