"""Model code for one device; parallelism is applied from outside (hyperpar_gdn.distributed).

The torch models (``GatedDeltaNet``, ``HybridLM``, ...) load on first use, so that
``HybridLMConfig`` and ``Qwen35Config`` (framework-free) and the MindSpore twins in
:mod:`hyperpar_gdn.models.mindspore` import without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

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


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hyperpar_gdn.models' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
