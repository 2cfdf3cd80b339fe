"""The tiny models the tests build, each configuration written once.

- :data:`TINY_LM`: our :class:`HybridLMConfig` at hidden 32 (4 blocks, 3 GDN + 1 softmax
  attention; GDN 2 key heads and 4 value heads of 8; attention 4 query heads and 2 K/V heads of 8).
- :func:`tiny_config` / :func:`tiny_model`: transformers' Qwen3.5 text model (dense or MoE),
  hidden 32, 4 layers (GDN, GDN, GDN, attention), its parameters moved off their init in fp64:
  the model of the gradient and context-parallel tests.
- :func:`generation_config` / :func:`generation_model`: the same sizes with the attention third of
  four layers (a GDN layer follows it), vocabulary :data:`GENERATION_VOCAB`, pad id 0 and larger
  weights (peaked logits: greedy decoding has no near ties): the model of the decoding tests.
- :func:`gdn_layer_config` / :func:`transformers_gdn_layer`: one transformers
  ``Qwen3_5GatedDeltaNet`` (hidden 32, 2 key heads, 4 value heads of 8, conv 4).
- :func:`move_off_init`: noise on every parameter, optionally a slow GDN decay.

transformers is imported only by the functions that build its models.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hyperpar_gdn.models.config import FULL, LINEAR, HybridLMConfig

__all__ = [
    "GENERATION_VOCAB",
    "TINY_LM",
    "gdn_layer_config",
    "generation_config",
    "generation_model",
    "move_off_init",
    "tiny_config",
    "tiny_model",
    "transformers_gdn_layer",
]

TINY_LM = HybridLMConfig(
    hidden_size=32,
    num_layers=4,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
)
GENERATION_VOCAB = 97


def move_off_init(module: torch.nn.Module, scale: float, *, dt_bias_shift: float | None = None) -> None:
    """Add ``scale`` times standard-normal noise to every parameter of ``module`` (at their init,
    norm weights of zeros or ones would hide a wrong gradient or a norm written the wrong way).

    With ``dt_bias_shift``, every GDN layer inside (a module with ``A_log`` and ``dt_bias``, the
    module itself included) then gets a slow decay: ``A_log = log(U(0.05, 0.5))`` and ``dt_bias``
    shifted by ``dt_bias_shift``, so the state entering a shard, a document or a step matters.
    Draws from torch's global generator, in the modules' order.
    """
    with torch.no_grad():
        for p in module.parameters():
            p.add_(scale * torch.randn_like(p))
        if dt_bias_shift is None:
            return
        for layer in module.modules():
            if hasattr(layer, "A_log") and hasattr(layer, "dt_bias"):
                layer.A_log.copy_(torch.log(torch.empty_like(layer.A_log).uniform_(0.05, 0.5)))
                layer.dt_bias.add_(dt_bias_shift)


def gdn_layer_config(*, key_head_dim: int = 16) -> Any:
    """transformers' config of one GDN layer: hidden 32, 2 key heads of ``key_head_dim``, 4 value
    heads of 8, conv 4 (a 1-layer text config whose layer 0 is ``linear_attention``)."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        hidden_size=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=key_head_dim,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        num_hidden_layers=1,
        layer_types=[LINEAR],
    )


def transformers_gdn_layer(*, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """transformers' ``Qwen3_5GatedDeltaNet`` of :func:`gdn_layer_config`, seeded, moved off its
    init (0.1) with a slow decay: the layer the CP and packed-document tests compare with."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    torch.manual_seed(0)
    layer = Qwen3_5GatedDeltaNet(gdn_layer_config(), layer_idx=0).to(dtype)
    move_off_init(layer, 0.1, dt_bias_shift=-4.0)
    return layer


def tiny_config(
    *,
    moe: bool,
    num_k_heads: int = 2,
    num_v_heads: int = 4,
    vocab_size: int = 61,
    layer_types: Sequence[str] = (LINEAR, LINEAR, LINEAR, FULL),
    pad_token_id: int | None = None,
    num_experts: int = 4,
) -> Any:
    """A 4-layer transformers Qwen3.5 text config (hidden 32; GDN ``num_k_heads`` key heads and
    ``num_v_heads`` value heads of 8; attention 4 heads and 2 K/V heads of 16, half of each rotated), dense
    (intermediate 48) or MoE (``num_experts`` experts, 2 per token, eager experts: the grouped matmul refuses
    float64)."""
    import transformers

    if len(layer_types) != 4:
        raise ValueError(f"layer_types={list(layer_types)} must name 4 layers")
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=4,
        layer_types=list(layer_types),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=num_k_heads,
        linear_num_value_heads=num_v_heads,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        tie_word_embeddings=False,
        pad_token_id=pad_token_id,
    )
    if not moe:
        return transformers.Qwen3_5TextConfig(**common, intermediate_size=48)
    config = transformers.Qwen3_5MoeTextConfig(
        **common,
        num_experts=num_experts,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=24,
    )
    config._experts_implementation = "eager"  # not saved by save_pretrained
    return config


def _causal_lm(config: Any) -> torch.nn.Module:
    import transformers

    moe = isinstance(config, transformers.Qwen3_5MoeTextConfig)
    cls = transformers.Qwen3_5MoeForCausalLM if moe else transformers.Qwen3_5ForCausalLM
    return cls(config)


def tiny_model(
    *, moe: bool, num_k_heads: int = 2, num_v_heads: int = 4, vocab_size: int = 61, num_experts: int = 4
) -> torch.nn.Module:
    """transformers' causal LM of :func:`tiny_config`, seeded, in float64, moved off its init
    (0.05) with a slow decay."""
    torch.manual_seed(0)
    config = tiny_config(
        moe=moe,
        num_k_heads=num_k_heads,
        num_v_heads=num_v_heads,
        vocab_size=vocab_size,
        num_experts=num_experts,
    )
    model = _causal_lm(config)
    model = model.to(torch.float64)
    move_off_init(model, 0.05, dt_bias_shift=-4.0)
    return model


def generation_config(*, moe: bool) -> Any:
    """:func:`tiny_config` of the decoding tests: attention third of four layers, vocabulary
    :data:`GENERATION_VOCAB`, pad id 0."""
    return tiny_config(
        moe=moe, vocab_size=GENERATION_VOCAB, layer_types=(LINEAR, LINEAR, FULL, LINEAR), pad_token_id=0
    )


def generation_model(
    *, moe: bool, dtype: torch.dtype = torch.float32, dt_bias_shift: float | None = -3.0
) -> torch.nn.Module:
    """transformers' causal LM of :func:`generation_config`, seeded, moved off its init by 0.3
    (peaked logits: no near ties in greedy decoding), then cast to ``dtype``, in eval mode; with
    ``dt_bias_shift``, a slow decay (the prompt's state matters)."""
    torch.manual_seed(0)
    model = _causal_lm(generation_config(moe=moe))
    move_off_init(model, 0.3, dt_bias_shift=dt_bias_shift)
    return model.to(dtype).eval()
