"""A model's parallelisms composed in one order (torch): the parts that wrap a model last.

- :mod:`.checkpointing`: activation checkpointing, one decoder layer at a time.
- :mod:`.fsdp`: parameters, gradients and optimizer state sharded over the data ranks (FSDP2).
"""

from hyperpar_gdn._lazy import lazy_exports

_EXPORTS = {
    "apply_activation_checkpointing": "hyperpar_gdn.parallel.checkpointing",
    "apply_fsdp": "hyperpar_gdn.parallel.fsdp",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
