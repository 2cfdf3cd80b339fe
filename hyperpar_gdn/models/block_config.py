"""The block-building interface that the decoder blocks of both frameworks read from a model
config (``HybridLMConfig`` or ``Qwen35Config``): the mixers' constructor arguments, the norm kind
and whether the MLP is a mixture of experts. Framework-free."""

from __future__ import annotations

from typing import Any

__all__ = ["DecoderSizes"]


class DecoderSizes:
    """Mixin for a config with transformers' Qwen3.5 size names (``hidden_size``,
    ``linear_num_key_heads``, ..., ``num_attention_heads``, ``head_dim``, ``rope_theta``,
    ``rms_norm_eps``)."""

    zero_centred_norms = False  # plain RMSNorm weight * x / rms(x); True: x / rms(x) * (1 + weight)
    num_experts = 0  # a dense SwiGLU MLP in every block
    num_experts_per_tok = moe_intermediate_size = shared_expert_intermediate_size = 0  # MoE sizes
    tie_word_embeddings = True  # the LM head is the embedding's weight
    rotary_dim: int | None = None  # RoPE over the whole head

    def gdn_kwargs(self: Any) -> dict[str, Any]:
        """The keyword arguments of a GDN mixer (``GatedDeltaNet(**kwargs)``, either framework)."""
        return {
            "hidden_size": self.hidden_size,
            "num_k_heads": self.linear_num_key_heads,
            "num_v_heads": self.linear_num_value_heads,
            "head_k_dim": self.linear_key_head_dim,
            "head_v_dim": self.linear_value_head_dim,
            "conv_kernel_size": self.linear_conv_kernel_dim,
            "norm_eps": self.rms_norm_eps,
        }

    def attention_kwargs(self: Any) -> dict[str, Any]:
        """The keyword arguments of a softmax mixer (``CausalSelfAttention(**kwargs)``)."""
        return {
            "hidden_size": self.hidden_size,
            "num_heads": self.num_attention_heads,
            "num_kv_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "norm_eps": self.rms_norm_eps,
            "rotary_dim": self.rotary_dim,
            "zero_centred_norms": self.zero_centred_norms,
        }
