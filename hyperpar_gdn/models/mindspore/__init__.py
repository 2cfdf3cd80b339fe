"""MindSpore model code for one device; parallelism is applied from outside
(``LinearAttentionContextParallel(mode).apply(cell, mesh)`` under ``HP_PLATFORM=mindspore``)."""

from .gated_deltanet import CausalDepthwiseConv1d, GatedDeltaNet, GatedRMSNorm

__all__ = ["CausalDepthwiseConv1d", "GatedDeltaNet", "GatedRMSNorm"]
