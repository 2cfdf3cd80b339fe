"""DTensor-lite: a local tensor plus how it is laid out over a :class:`DeviceMesh`.

One placement per mesh dim: ``Shard(d)`` (tensor dim ``d`` is split evenly across that mesh dim,
in mesh order) or ``Replicate()`` (every rank of that mesh dim holds the same tensor). Uneven
shards are not supported: the global size along a sharded dim is ``local size * mesh size``, and
:func:`distribute_tensor` refuses sizes that do not divide.

Framework-agnostic: communication goes through the mesh's platform, slicing through Python
indexing and its tensor functions. Gathering is differentiable.

Example (a 1-D cp mesh of 4 ranks, a sequence split over cp)::

    x = DTensor.from_local(x_local, mesh, [Shard(1)])   # x_local [B, T/4, H]
    x.shape                                             # (B, T, H)
    x.full_tensor()                                     # [B, T, H] on every rank
    distribute_tensor(x_full, mesh, [Shard(1)]).to_local()  # this rank's [B, T/4, H]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hyperpar_gdn.distributed.mesh import DeviceMesh
from hyperpar_gdn.platform import Tensor

__all__ = ["DTensor", "Placement", "Replicate", "Shard", "distribute_tensor"]


@dataclass(frozen=True)
class Shard:
    """Tensor dim ``dim`` is split evenly over a mesh dim (negative dims count from the end)."""

    dim: int


@dataclass(frozen=True)
class Replicate:
    """Every rank of a mesh dim holds the whole tensor."""


Placement = Shard | Replicate


class DTensor:
    """A rank's local tensor, its mesh and its placements (one per mesh dim).

    Build one with :meth:`from_local` or :func:`distribute_tensor`; nothing is communicated until
    :meth:`full_tensor`.
    """

    def __init__(self, local: Tensor, device_mesh: DeviceMesh, placements: Sequence[Placement]) -> None:
        self._local = local
        self._mesh = device_mesh
        self._placements = _normalize(placements, device_mesh, len(local.shape))

    @classmethod
    def from_local(cls, local: Tensor, device_mesh: DeviceMesh, placements: Sequence[Placement]) -> DTensor:
        """Wrap this rank's ``local`` tensor (no copy, no communication). Every rank must hold a
        shard of the same shape: uneven shards are not supported."""
        return cls(local, device_mesh, placements)

    def to_local(self) -> Tensor:
        """This rank's tensor (the same object that was wrapped; gradients flow through it)."""
        return self._local

    @property
    def placements(self) -> tuple[Placement, ...]:
        return self._placements

    @property
    def device_mesh(self) -> DeviceMesh:
        return self._mesh

    @property
    def shape(self) -> tuple[int, ...]:
        """The global shape: each ``Shard(d)`` multiplies dim ``d`` by its mesh dim's size."""
        shape = list(self._local.shape)
        for axis, placement in enumerate(self._placements):
            if isinstance(placement, Shard):
                shape[placement.dim] *= self._mesh.size(axis)
        return tuple(shape)

    def full_tensor(self) -> Tensor:
        """The global tensor on every rank (all-gathers along each sharded mesh dim, innermost mesh
        dim first; differentiable: the gradient is reduce-scattered back to the shards)."""
        platform = self._mesh.platform
        x = self._local
        for axis in reversed(range(self._mesh.ndim)):
            placement = self._placements[axis]
            if isinstance(placement, Shard):
                gathered = platform.collectives.all_gather(x, self._mesh.get_group(axis))
                size = self._mesh.size(axis)
                x = platform.ops.cat([gathered[i] for i in range(size)], placement.dim)
        return x

    def __repr__(self) -> str:
        return f"DTensor(shape={self.shape}, placements={self._placements}, mesh={self._mesh!r})"


def distribute_tensor(full: Tensor, device_mesh: DeviceMesh, placements: Sequence[Placement]) -> DTensor:
    """This rank's part of the global tensor ``full`` (the same on every rank), by slicing: no
    communication; differentiable. Sharded sizes must divide evenly by their mesh dim's size."""
    placements = _normalize(placements, device_mesh, len(full.shape))
    local = full
    coordinate = device_mesh.get_coordinate()
    for axis, placement in enumerate(placements):
        if not isinstance(placement, Shard):
            continue
        size, index = device_mesh.size(axis), coordinate[axis]
        length = local.shape[placement.dim]
        if length % size:
            raise ValueError(
                f"tensor dim {placement.dim} of size {length} (global shape {tuple(full.shape)}) does not "
                f"split evenly over mesh dim {axis} of size {size}; uneven shards are not supported"
            )
        step = length // size
        index_tuple: tuple[Any, ...] = (slice(None),) * placement.dim + (
            slice(index * step, (index + 1) * step),
        )
        local = local[index_tuple]
    return DTensor(local, device_mesh, placements)


def _normalize(placements: Sequence[Placement], mesh: DeviceMesh, ndim: int) -> tuple[Placement, ...]:
    placements = tuple(placements)
    if len(placements) != mesh.ndim:
        raise ValueError(
            f"placements={placements} must have one entry per mesh dim; the mesh has shape {mesh.shape}"
        )
    normalized: list[Placement] = []
    for placement in placements:
        if isinstance(placement, Shard):
            if not -ndim <= placement.dim < ndim:
                raise ValueError(f"{placement} is out of range for a tensor with {ndim} dims")
            normalized.append(Shard(placement.dim % ndim))
        elif isinstance(placement, Replicate):
            normalized.append(placement)
        else:
            raise TypeError(f"placements must be Shard(dim) or Replicate(), got {placement!r}")
    return tuple(normalized)
