"""DTensor-lite: a local tensor plus how it is laid out over a :class:`DeviceMesh`.

One placement per mesh dim: ``Shard(d)`` (tensor dim ``d`` is split evenly across that mesh dim,
in mesh order), ``Shard(d, layout="head_tail")`` (split into 2n pieces, rank r holding pieces r
and 2n-1-r: :mod:`hyperpar_gdn.distributed.layout`) or ``Replicate()`` (every rank of that mesh dim
holds the same tensor). Uneven shards are not supported: the global size along a sharded dim is
``local size * mesh size``, and :func:`distribute_tensor` refuses sizes that do not divide.

The context-parallel styles read the placements: a GDN or attention layer takes a DTensor that
is a sequence shard (``Shard(1, layout=...)`` of ``[B, T, hidden]`` on the 1-D CP mesh, in the
style's layout), refuses any other, and returns its output with the same placement
(:func:`as_sequence_shard`).

Framework-agnostic: communication goes through the mesh's platform, slicing through Python
indexing and its tensor functions. Gathering is differentiable.

Example (a 1-D cp mesh of 4 ranks, a sequence split over cp)::

    x = DTensor.from_local(x_local, mesh, [Shard(1)])   # x_local [B, T/4, H]
    x.shape                                             # (B, T, H)
    x.full_tensor()                                     # [B, T, H] on every rank
    distribute_tensor(x_full, mesh, [Shard(1)]).to_local()  # this rank's [B, T/4, H]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hyperpar_gdn.distributed.layout import TokenLayout
from hyperpar_gdn.distributed.mesh import DeviceMesh
from hyperpar_gdn.planning.plan import check_layout
from hyperpar_gdn.platform import Tensor

__all__ = ["DTensor", "Placement", "Replicate", "Shard", "as_sequence_shard", "distribute_tensor"]


@dataclass(frozen=True)
class Shard:
    """Tensor dim ``dim`` is split evenly over a mesh dim (negative dims count from the end), in
    ``layout``: ``"contiguous"`` (rank r holds the r-th piece) or ``"head_tail"`` (pieces r and
    2n-1-r of 2n)."""

    dim: int
    layout: str = "contiguous"

    def __post_init__(self) -> None:
        check_layout(self.layout)

    def __repr__(self) -> str:
        extra = "" if self.layout == "contiguous" else f", layout={self.layout!r}"
        return f"Shard(dim={self.dim}{extra})"

    def pieces(self, local_length: int, size: int) -> TokenLayout:
        """Which global positions each rank holds along ``dim``."""
        return TokenLayout.of(self.layout, [local_length] * size)


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
                size, length = self._mesh.size(axis), x.shape[placement.dim]
                x = platform.ops.cat([gathered[i] for i in range(size)], placement.dim)
                x = placement.pieces(length, size).to_global(platform.ops, x, placement.dim)
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
        pieces = placement.pieces(length // size, size)
        local = pieces.local(device_mesh.platform.ops, local, index, placement.dim)
    return DTensor(local, device_mesh, placements)


def as_sequence_shard(x: Any, *, owner: str, layout: str, dim: int = 1) -> tuple[Any, Callable[[Any], Any]]:
    """What a context-parallel style takes from ``x``: this rank's sequence shard, and how to give
    its output the same placement.

    A plain tensor is the shard itself (returned as is, output unwrapped). A :class:`DTensor` must
    be a sequence shard in the style's ``layout``: one placement, ``Shard(dim, layout=layout)``
    (``dim`` 1, the T of ``[B, T, ...]``); the output is wrapped with that placement on the same
    mesh. Any other DTensor (replicated, sharded on another dim or in another layout) is refused
    with a ValueError naming its placements, before any communication (placements are the same on
    every rank)."""
    if not isinstance(x, DTensor):
        return x, lambda y: y
    expected = (Shard(dim, layout),)
    if x.placements != expected:
        raise ValueError(
            f"{owner} takes a DTensor that is a sequence shard, placements={expected} on the 1-D CP "
            f"mesh; got placements={x.placements}"
        )
    mesh = x.device_mesh
    return x.to_local(), lambda y: DTensor.from_local(y, mesh, expected)


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
            normalized.append(Shard(placement.dim % ndim, placement.layout))
        elif isinstance(placement, Replicate):
            normalized.append(placement)
        else:
            raise TypeError(f"placements must be Shard(dim) or Replicate(), got {placement!r}")
    return tuple(normalized)
