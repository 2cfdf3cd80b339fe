"""Model code for one device; parallelism is applied from outside (hyperpar_gdn.distributed)."""

from hyperpar_gdn.models.attention import CausalSelfAttention
from hyperpar_gdn.models.gated_deltanet import GatedDeltaNet, GatedRMSNorm
from hyperpar_gdn.models.lm import HybridLM, HybridLMConfig
from hyperpar_gdn.models.norm import RMSNorm

__all__ = ["CausalSelfAttention", "GatedDeltaNet", "GatedRMSNorm", "HybridLM", "HybridLMConfig", "RMSNorm"]
