"""Model code for one device; parallelism is applied from outside (hyperpar_gdn.distributed).

The torch models (``GatedDeltaNet``, ``HybridLM``, ...) load on first use, so that
``HybridLMConfig`` and ``Qwen35Config`` (framework-free) and the MindSpore twins in
:mod:`hyperpar_gdn.models.mindspore` import without torch.
"""

from __future__ import annotations

from hyperpar_gdn._lazy import lazy_exports

_EXPORTS = {
    "CausalSelfAttention": "hyperpar_gdn.models.attention",
    "GatedDeltaNet": "hyperpar_gdn.models.gated_deltanet",
    "GatedRMSNorm": "hyperpar_gdn.models.gated_deltanet",
    "HybridLM": "hyperpar_gdn.models.lm",
    "HybridLMConfig": "hyperpar_gdn.models.config",
    "Qwen35Config": "hyperpar_gdn.models.qwen35_config",
    "RMSNorm": "hyperpar_gdn.models.norm",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
