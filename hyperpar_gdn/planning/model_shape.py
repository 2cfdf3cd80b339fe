"""The sizes of a model that decide its training memory (:mod:`.memory`): its parameters per
decoder layer, its largest parameter, its parameter count; framework-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hyperpar_gdn.models.block_config import DecoderSizes
from hyperpar_gdn.models.qwen35_config import Qwen35Config

__all__ = ["FULL", "LINEAR", "ModelShape"]

LINEAR, FULL = "linear_attention", "full_attention"  # the layer types of a config's layer_types


@dataclass(frozen=True)
class ModelShape:
    """The sizes that decide memory: ``config``, a model config with transformers' Qwen3.5 size
    names (a ``HybridLMConfig`` or a ``Qwen35Config``), whose attributes a shape reads through
    (``shape.hidden_size``). :meth:`of` also takes a config.json dict or a transformers config."""

    config: Any

    @classmethod
    def of(cls, config: Any, *, where: str = "the model config") -> ModelShape:
        """The shape of a model config, a config.json dict or a transformers config (parsed as
        ``Qwen35Config`` reads a model directory, accepting what only the MindSpore model refuses;
        its errors name ``where``)."""
        if isinstance(config, DecoderSizes):
            return cls(config)
        text = config if isinstance(config, dict) else config.to_dict()
        return cls(Qwen35Config.from_dict(text, where=where, sizes_only=True))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "config":  # copying and pickling look for these first
            raise AttributeError(name)
        return getattr(self.config, name)

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.value_dim

    @property
    def routed_experts(self) -> int:
        """The routed experts whose weights a rank holds (all ``num_experts`` of the whole model)."""
        return self.num_experts

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    def layer_parameters(self, kind: str) -> int:
        """Parameters of one decoder layer of ``kind`` (its two norms, mixer and MLP)."""
        c, h = self.hidden_size, self.linear_num_value_heads
        if kind == LINEAR:
            conv = self.conv_dim
            mixer = c * conv + 2 * c * self.value_dim + 2 * c * h + conv * self.linear_conv_kernel_dim
            mixer += 2 * h + self.linear_value_head_dim
        else:
            q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
            mixer = 2 * c * q + 2 * c * kv + q * c + 2 * self.head_dim
        if self.num_experts:
            e, im = self.routed_experts, self.moe_intermediate_size
            # the experts held, the shared expert, the router's [E, C] and the shared gate's [1, C]
            mlp = 3 * c * (e * im + self.shared_expert_intermediate_size) + self.num_experts * c + c
        else:
            mlp = 3 * c * self.intermediate_size
        return 2 * c + mixer + mlp

    def largest_parameter(self) -> int:
        """Elements of the largest single parameter (the embedding, a projection, an expert stack)."""
        c = self.hidden_size
        sizes = [self.vocab_size * c, c * self.conv_dim, c * self.intermediate_size]
        sizes.append(2 * c * self.num_attention_heads * self.head_dim)  # the query with its gate
        if self.num_experts:  # the experts' gate and up projections, one [E, 2I, C] tensor
            sizes.append(2 * self.routed_experts * self.moe_intermediate_size * c)
        return max(sizes)

    def expert_parameters(self) -> int:
        """Parameters of the routed experts held (every MoE layer's ``gate_up_proj`` and ``down_proj``)."""
        if not self.num_experts:
            return 0
        per_layer = 3 * self.hidden_size * self.routed_experts * self.moe_intermediate_size
        return per_layer * len(self.layer_types)

    def num_parameters(self) -> int:
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return embed + self.hidden_size + sum(self.layer_parameters(k) for k in self.layer_types)
