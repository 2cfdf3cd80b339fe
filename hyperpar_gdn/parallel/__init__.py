"""A model's parallelisms composed in one order: ``parallelize(model, mesh, ParallelConfig(...))``.

- :mod:`.config`: ``ParallelConfig``, every parallelism's options, checked on their own.
- :mod:`.compose`: ``parallelize``: every part's checks on every rank, then expert, tensor and
  context parallelism, activation checkpointing and FSDP2, in that order.
- :mod:`.checkpointing`: activation checkpointing, one decoder layer at a time.
- :mod:`.fsdp`: parameters, gradients and optimizer state sharded over the data ranks (FSDP2).
"""

from hyperpar_gdn._lazy import lazy_exports

_EXPORTS = {
    "ParallelConfig": "hyperpar_gdn.parallel.config",
    "Parallelized": "hyperpar_gdn.parallel.compose",
    "parallelize": "hyperpar_gdn.parallel.compose",
    "apply_activation_checkpointing": "hyperpar_gdn.parallel.checkpointing",
    "apply_fsdp": "hyperpar_gdn.parallel.fsdp",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
