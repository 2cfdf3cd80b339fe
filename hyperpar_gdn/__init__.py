"""hyperpar-gdn: context parallelism for Gated DeltaNet layers on PyTorch and MindSpore.

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("cp",))
    LinearAttentionContextParallel(mode="ulysses").apply(layer, mesh)

The names below load on first use, so ``import hyperpar_gdn.ops`` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DTensor": "hyperpar_gdn.distributed.dtensor",
    "Replicate": "hyperpar_gdn.distributed.dtensor",
    "Shard": "hyperpar_gdn.distributed.dtensor",
    "DeviceMesh": "hyperpar_gdn.distributed.mesh",
    "init_device_mesh": "hyperpar_gdn.distributed.mesh",
    "LinearAttentionContextParallel": "hyperpar_gdn.distributed.style",
    "ParallelStyle": "hyperpar_gdn.distributed.style",
    "SoftmaxAttentionContextParallel": "hyperpar_gdn.distributed.attention_style",
    "apply_context_parallel": "hyperpar_gdn.distributed.parallelize",
    "undo_context_parallel": "hyperpar_gdn.distributed.parallelize",
    "ContextParallelBatch": "hyperpar_gdn.distributed.batch",
    "context_parallel_lm_loss": "hyperpar_gdn.distributed.batch",
    "context_parallel_loss": "hyperpar_gdn.distributed.batch",
    "shard_for_context_parallel": "hyperpar_gdn.distributed.batch",
    "get_platform": "hyperpar_gdn.platform",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hyperpar_gdn' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
