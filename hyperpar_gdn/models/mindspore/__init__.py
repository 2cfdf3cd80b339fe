"""MindSpore model code for one device; parallelism is applied from outside
(``LinearAttentionContextParallel(mode).apply(cell, mesh)`` or
``apply_context_parallel(model, mesh, mode=...)`` under ``HP_PLATFORM=mindspore``)."""

from .attention import CausalSelfAttention
from .gated_deltanet import CausalDepthwiseConv1d, GatedDeltaNet, GatedRMSNorm
from .lm import HybridLM, HybridLMConfig, load_torch_state_dict
from .norm import RMSNorm

__all__ = [
    "CausalDepthwiseConv1d",
    "CausalSelfAttention",
    "GatedDeltaNet",
    "GatedRMSNorm",
    "HybridLM",
    "HybridLMConfig",
    "RMSNorm",
    "load_torch_state_dict",
]
