"""Distributed building blocks above the platform layer (no framework named here).

- :mod:`.mesh`: :class:`DeviceMesh`, :func:`init_device_mesh` (torch's API, any platform) and
  :func:`as_cp_mesh` (our 1-D mesh or a 1-D torch ``DeviceMesh`` -> the mesh the CP code uses).
- :mod:`.dtensor`: DTensor-lite: :class:`DTensor` with ``Shard``/``Replicate`` placements.

Loaded on first use, so the model adapters' registry (:mod:`.adapters`) imports nothing else.
"""

from __future__ import annotations

from hyperpar_gdn._lazy import lazy_exports

_EXPORTS = {
    "DTensor": "hyperpar_gdn.distributed.dtensor",
    "Placement": "hyperpar_gdn.distributed.dtensor",
    "Replicate": "hyperpar_gdn.distributed.dtensor",
    "Shard": "hyperpar_gdn.distributed.dtensor",
    "distribute_tensor": "hyperpar_gdn.distributed.dtensor",
    "DeviceMesh": "hyperpar_gdn.distributed.mesh",
    "as_cp_mesh": "hyperpar_gdn.distributed.mesh",
    "init_device_mesh": "hyperpar_gdn.distributed.mesh",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
