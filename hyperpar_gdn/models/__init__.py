"""Model code for one device; parallelism is applied from outside (hyperpar_gdn.distributed)."""

from .attention import CausalSelfAttention
from .gated_deltanet import GatedDeltaNet, GatedRMSNorm
from .lm import HybridLM, HybridLMConfig
from .norm import RMSNorm

__all__ = ["CausalSelfAttention", "GatedDeltaNet", "GatedRMSNorm", "HybridLM", "HybridLMConfig", "RMSNorm"]
