"""transformers' Qwen3.5 models as context parallelism sees them: :class:`TransformersAdapter`,
registered with the core's adapters (:mod:`hyperpar_gdn.distributed.adapters`) when this module is
imported (``import hyperpar_gdn`` imports it; transformers itself is imported only by the models).

Their decoder layers are found by :mod:`.discovery`, each forward's inputs put right for a shard
by :mod:`.hooks` (which passes the whole sequence's description to the mixers as ``cp_context=``:
transformers' decoder layers pass their keywords on to both mixers) and their attention layers
adapted by :mod:`.attention`. Under tensor parallelism their GDN layers take the forward of
:mod:`.head_sharded`, and their hub kernels stay off (:mod:`.hub_kernels`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hyperpar_gdn.distributed.adapters import FamilyInference, ModelAdapter, register_adapter
from hyperpar_gdn.integrations.transformers.discovery import (
    ATTENTION_LAYERS,
    find_text_model,
    from_transformers,
    is_qwen35,
)

__all__ = ["TransformersAdapter"]


@register_adapter
class TransformersAdapter(ModelAdapter):
    """transformers' ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM``, their text models, and the
    language model of ``Qwen3_5(Moe)ForConditionalGeneration`` / ``Qwen3_5(Moe)Model``."""

    name = "transformers"
    models = (
        "transformers' Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM, their text models, or "
        "Qwen3_5(Moe)ForConditionalGeneration"
    )
    attention_layers = "transformers' Qwen3.5 attention"
    silu_activations = ("SiLU", "SiLUActivation")
    cu_seqlens_keywords = ("cu_seqlens", "cu_seq_lens_q")  # fla's name, transformers' name

    @classmethod
    def declines(cls, model: Any) -> str | None:
        return None if is_qwen35(model) else "not one of transformers' Qwen3.5 models"

    @classmethod
    def declines_layer(cls, module: Any) -> str | None:
        return None if type(module).__name__ in ATTENTION_LAYERS else "not transformers' Qwen3.5 attention"

    def decoder(self, model: Any) -> tuple[Any, Any]:
        return find_text_model(model)

    def install_forward(self, model: Any, outer: Any, text_model: Any, mesh: Any, layout: str) -> None:
        from hyperpar_gdn.integrations.transformers.hooks import install_hooks

        install_hooks(model, outer, text_model, mesh, layout)

    def remove_forward(self, model: Any, text_model: Any) -> None:
        from hyperpar_gdn.integrations.transformers.hooks import remove_hooks

        remove_hooks(text_model)

    def attention_forward(self, module: Any, mesh: Any, layout: str) -> Callable:
        from hyperpar_gdn.integrations.transformers.attention import transformers_attention_forward

        return transformers_attention_forward(module, mesh, layout)

    @classmethod
    def owns(cls, obj: Any) -> bool:
        return from_transformers(obj)

    def attention_heads(self, module: Any) -> tuple[int, int] | None:
        return int(module.config.num_attention_heads), int(module.config.num_key_value_heads)

    def set_local_attention_heads(self, module: Any, heads: int, kv_heads: int) -> None:
        module.num_key_value_groups = heads // kv_heads  # its forward reads the heads off the shapes

    def head_sharded_gdn_forward(self, module: Any) -> Callable | None:
        from hyperpar_gdn.integrations.transformers.head_sharded import head_sharded_gdn_forward

        return head_sharded_gdn_forward(module)

    def inference(self) -> FamilyInference | None:
        from hyperpar_gdn.integrations.transformers.inference import TransformersInference

        return TransformersInference()

    def keep_installed_forwards(self, model: Any) -> None:
        from hyperpar_gdn.integrations.transformers.hub_kernels import pause_hub_kernels

        pause_hub_kernels(model)  # for good: a re-kernelization would drop the installed forwards
