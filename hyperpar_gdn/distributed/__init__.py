"""Distributed building blocks above the platform layer (no framework named here).

- :mod:`.mesh`: :class:`DeviceMesh`, :func:`init_device_mesh` (torch's API, any platform) and
  :func:`as_cp_mesh` (our 1-D mesh or a 1-D torch ``DeviceMesh`` -> the mesh the CP code uses).
- :mod:`.dtensor`: DTensor-lite: :class:`DTensor` with ``Shard``/``Replicate`` placements.
"""

from hyperpar_gdn.distributed.dtensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from hyperpar_gdn.distributed.mesh import DeviceMesh, as_cp_mesh, init_device_mesh

__all__ = [
    "DTensor",
    "DeviceMesh",
    "Placement",
    "Replicate",
    "Shard",
    "as_cp_mesh",
    "distribute_tensor",
    "init_device_mesh",
]
