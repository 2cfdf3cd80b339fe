"""A small hybrid decoder language model, laid out like Qwen3.5.

Every block is pre-norm: ``x + mixer(norm(x))`` then ``x + mlp(norm(x))``. The mixer of 3 of every
4 blocks is a :class:`~hyperpar_gdn.models.GatedDeltaNet` (``linear_attn``); every 4th block's is
causal softmax attention (``self_attn``). The LM head shares the embedding's weight.

Written for one device. ``hyperpar_gdn.distributed.parallelize.apply_context_parallel`` makes it
take and return a sequence shard, with the same result.

Legend: B batch, T tokens, C hidden size, V vocabulary.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hyperpar_gdn.models.attention import CausalSelfAttention
from hyperpar_gdn.models.block_config import FULL, LINEAR, DecoderSizes
from hyperpar_gdn.models.gated_deltanet import GatedDeltaNet
from hyperpar_gdn.models.norm import RMSNorm
from hyperpar_gdn.models.shells import DecoderBlockShell, MLPShell
from hyperpar_gdn.ops.blocks import lm_logits
from hyperpar_gdn.platform import ops_for

_TORCH = ops_for(torch.empty(0))


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


class MLP(MLPShell, nn.Module):
    """SwiGLU (:class:`~hyperpar_gdn.models.shells.MLPShell`) for PyTorch."""

    def _linear(self, in_features: int, out_features: int) -> nn.Module:
        return nn.Linear(in_features, out_features, bias=False)


class DecoderBlock(DecoderBlockShell, nn.Module):
    """Pre-norm decoder block (:class:`~hyperpar_gdn.models.shells.DecoderBlockShell`) for PyTorch;
    its MLP is SwiGLU (no mixture of experts)."""

    def _rms_norm(self, config: Any) -> nn.Module:
        return RMSNorm(config.hidden_size, eps=config.rms_norm_eps, zero_centred=config.zero_centred_norms)

    def _gdn(self, config: Any) -> nn.Module:
        return GatedDeltaNet(**config.gdn_kwargs())

    def _attention(self, config: Any) -> nn.Module:
        return CausalSelfAttention(**config.attention_kwargs())

    def _mlp(self, config: Any) -> nn.Module:
        if config.num_experts:
            raise NotImplementedError(f"num_experts={config.num_experts}: the torch DecoderBlock has no MoE")
        return MLP(config.hidden_size, config.intermediate_size)


class HybridLM(nn.Module):
    """Decoder LM: embedding, :class:`DecoderBlock` s, final RMSNorm, tied LM head.

    forward(input_ids ``[B, T]`` int64) -> logits ``[B, T, V]`` (fp32, or fp64 for an fp64 model). Token t of the input
    sits at position t (under context parallelism: at its global position).

    Example:
        >>> model = HybridLM(HybridLMConfig(num_layers=4))
        >>> tuple(model(torch.randint(0, 256, (2, 16))).shape)
        (2, 16, 256)
    """

    def __init__(self, config: HybridLMConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderBlock(config, kind) for kind in config.layer_types)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self._init_weights()

    def _init_weights(self) -> None:
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)

    def forward(
        self, input_ids: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None, return_hidden: bool = False
    ) -> torch.Tensor:
        """``cu_seqlens`` (int ``[N+1]``, B = 1): packed documents; every mixer restarts at each
        (under context parallelism: the global boundaries, the same tensor on every rank).
        ``return_hidden``: return the final hidden states ``[B, T, C]`` (after the final norm)
        instead of the logits, for a loss that applies the head itself
        (:func:`hyperpar_gdn.context_parallel_lm_loss` with ``embed_tokens.weight``)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T]; got shape {tuple(input_ids.shape)}")
        x_BTC = self.embed_tokens(input_ids)
        for block in self.layers:
            x_BTC = block(x_BTC, cu_seqlens=cu_seqlens)
        if return_hidden:
            return self.norm(x_BTC)
        return lm_logits(_TORCH, self.norm(x_BTC), self.embed_tokens.weight)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
