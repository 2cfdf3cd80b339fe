"""MindSpore model code for one device; parallelism is applied from outside
(``LinearAttentionContextParallel(mode).apply(cell, mesh)`` or
``apply_context_parallel(model, mesh, mode=...)`` under ``HP_PLATFORM=mindspore``).

``Qwen3_5ForCausalLM.from_pretrained(DIR)`` builds transformers' Qwen3.5 (dense or MoE) from a
transformers model directory; ``save_pretrained(DIR)`` writes one back."""

from hyperpar_gdn.models.mindspore.attention import CausalSelfAttention
from hyperpar_gdn.models.mindspore.gated_deltanet import CausalDepthwiseConv1d, GatedDeltaNet, GatedRMSNorm
from hyperpar_gdn.models.mindspore.lm import HybridLM, HybridLMConfig
from hyperpar_gdn.models.mindspore.moe import SparseMoeBlock
from hyperpar_gdn.models.mindspore.norm import RMSNorm
from hyperpar_gdn.models.mindspore.qwen35 import Qwen3_5ForCausalLM, Qwen35Config, Qwen35TextModel
from hyperpar_gdn.models.mindspore.weights import load_torch_state_dict

__all__ = [
    "CausalDepthwiseConv1d",
    "CausalSelfAttention",
    "GatedDeltaNet",
    "GatedRMSNorm",
    "HybridLM",
    "HybridLMConfig",
    "Qwen35Config",
    "Qwen35TextModel",
    "Qwen3_5ForCausalLM",
    "RMSNorm",
    "SparseMoeBlock",
    "load_torch_state_dict",
]
