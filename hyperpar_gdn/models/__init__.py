"""Model code for one device; parallelism is applied from outside (hyperpar_gdn.distributed)."""

from .gated_deltanet import GatedDeltaNet, GatedRMSNorm

__all__ = ["GatedDeltaNet", "GatedRMSNorm"]
