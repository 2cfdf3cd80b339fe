"""A small hybrid decoder language model, laid out like Qwen3.5.

Every block is pre-norm: ``x + mixer(norm(x))`` then ``x + mlp(norm(x))``. The mixer of 3 of every
4 blocks is a :class:`~hyperpar_gdn.models.GatedDeltaNet` (``linear_attn``); every 4th block's is
causal softmax attention (``self_attn``). The LM head shares the embedding's weight.

Written for one device. ``hyperpar_gdn.distributed.parallelize.apply_context_parallel`` makes it
take and return a sequence shard, with the same result. Its sizes, :class:`HybridLMConfig`, live in
:mod:`hyperpar_gdn.models.config` (no framework) and are re-exported here.

Legend: B batch, T tokens, C hidden size, V vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hyperpar_gdn.models.attention import CausalSelfAttention
from hyperpar_gdn.models.config import FULL, LINEAR, HybridLMConfig, check_layer_type
from hyperpar_gdn.models.gated_deltanet import GatedDeltaNet
from hyperpar_gdn.models.norm import RMSNorm
from hyperpar_gdn.models.shells import DecoderBlockShell, MLPShell
from hyperpar_gdn.ops.blocks import lm_logits
from hyperpar_gdn.platform import ops_for

__all__ = ["FULL", "LINEAR", "MLP", "DecoderBlock", "HybridLM", "HybridLMConfig", "check_layer_type"]

_TORCH = ops_for(torch.empty(0))


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
        self,
        input_ids: torch.Tensor,
        *,
        cu_seqlens: torch.Tensor | None = None,
        return_hidden: bool = False,
        cp_context: Any = None,
    ) -> torch.Tensor:
        """``cu_seqlens`` (int ``[N+1]``, B = 1): packed documents; every mixer restarts at each
        (under context parallelism: the global boundaries, the same tensor on every rank).
        ``return_hidden``: return the final hidden states ``[B, T, C]`` (after the final norm)
        instead of the logits, for a loss that applies the head itself
        (:func:`hyperpar_gdn.context_parallel_lm_loss` with ``embed_tokens.weight``).
        ``cp_context``: set by :func:`~hyperpar_gdn.apply_context_parallel`'s wrapper of this
        forward (the whole sequence's description, built once per forward for every mixer)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T]; got shape {tuple(input_ids.shape)}")
        x_BTC = self.embed_tokens(input_ids)
        for block in self.layers:
            x_BTC = block(x_BTC, cu_seqlens=cu_seqlens, cp_context=cp_context)
        if return_hidden:
            return self.norm(x_BTC)
        return lm_logits(_TORCH, self.norm(x_BTC), self.embed_tokens.weight)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
