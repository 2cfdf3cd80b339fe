"""A framework-agnostic device mesh with the API of ``torch.distributed.device_mesh``.

Ranks are laid out row-major, as in torch: for ``mesh_shape=(dp, cp)`` global rank
``r = i_dp * cp + i_cp``, so each cp group is ``cp`` consecutive ranks and each dp group strides
by ``cp``. "axis" or "mesh dim" means a dimension of the mesh; a dim may be named by its index or
by its name in ``mesh_dim_names``.

Example (4 processes launched by torchrun, or by :func:`hyperpar_gdn.platform.launch.run_ranks`)::

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    cp_mesh = mesh["cp"]               # 1-D: ranks {0, 1} or {2, 3}
    cp_mesh.get_local_rank()           # this rank's position along cp
    cp_mesh.rank_list                  # e.g. [2, 3]
    cp_mesh.platform.collectives.all_gather(x, cp_mesh.get_group())

:func:`as_cp_mesh` turns what a user hands to a parallel style (our 1-D mesh, or a 1-D torch
``DeviceMesh`` such as ``torch_mesh["cp"]``) into the 1-D :class:`DeviceMesh` the CP code uses.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

from hyperpar_gdn.platform import Group, Platform, get_platform, platform_for_device

__all__ = ["DeviceMesh", "as_cp_mesh", "init_device_mesh"]

_TORCH_DEVICE_TYPES = ("cpu", "cuda", "npu")


class DeviceMesh:
    """This process's view of an n-D mesh of ranks: the mesh layout and, along every mesh dim,
    the process group through this rank.

    Build one with :func:`init_device_mesh` (collective) or :meth:`from_group` (no communication).

    Attributes:
        platform: the :class:`~hyperpar_gdn.platform.Platform` whose groups and collectives it uses.
        device_type: the name the mesh was built for (``"cpu"``, ``"cuda"``, ``"npu"``, ``"mindspore"``).
        mesh_dim_names: one name per mesh dim, or ``None``.
    """

    def __init__(
        self,
        *,
        platform: Platform,
        device_type: str,
        shape: Sequence[int],
        ranks: Sequence[int],
        groups: Sequence[Group],
        mesh_dim_names: Sequence[str] | None = None,
    ) -> None:
        """Low-level constructor; prefer :func:`init_device_mesh` or :meth:`from_group`.

        Args:
            shape: the mesh shape.
            ranks: the global ranks of the whole mesh, flattened row-major (``prod(shape)`` of them).
            groups: per mesh dim, the process group along that dim through this rank.
        """
        shape = tuple(int(s) for s in shape)
        ranks = tuple(int(r) for r in ranks)
        if len(ranks) != math.prod(shape):
            raise ValueError(
                f"a mesh of shape {shape} needs {math.prod(shape)} ranks, got {len(ranks)}: {ranks}"
            )
        if len(groups) != len(shape):
            raise ValueError(f"a mesh of shape {shape} needs one group per dim, got {len(groups)}")
        names = _check_names(mesh_dim_names, shape)
        me = platform.rank()
        if me not in ranks:
            raise ValueError(f"global rank {me} is not in the mesh ranks {ranks}")
        self.platform = platform
        self.device_type = device_type
        self.mesh_dim_names = names
        self._shape = shape
        self._ranks = ranks
        self._groups = tuple(groups)
        self._coordinate = _unravel(ranks.index(me), shape)

    @classmethod
    def from_group(
        cls,
        platform: Platform,
        group: Group,
        ranks: Sequence[int],
        *,
        mesh_dim_name: str | None = None,
        device_type: str | None = None,
    ) -> DeviceMesh:
        """A 1-D mesh over an existing process ``group`` whose global ranks, in group rank order,
        are ``ranks``. No communication."""
        return cls(
            platform=platform,
            device_type=device_type or platform.name,
            shape=(len(ranks),),
            ranks=ranks,
            groups=(group,),
            mesh_dim_names=None if mesh_dim_name is None else (mesh_dim_name,),
        )

    # --- layout ----------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def ndim(self) -> int:
        return len(self._shape)

    def size(self, dim: int | str | None = None) -> int:
        """The number of ranks along ``dim``, or in the whole mesh when ``dim`` is None."""
        return math.prod(self._shape) if dim is None else self._shape[self._axis(dim)]

    def get_rank(self) -> int:
        """This process's global rank."""
        return self.platform.rank()

    def get_coordinate(self) -> tuple[int, ...]:
        """This rank's index along every mesh dim."""
        return self._coordinate

    def get_local_rank(self, dim: int | str | None = None) -> int:
        """This rank's index along ``dim`` (its rank in :meth:`get_group`); ``dim`` may be omitted
        on a 1-D mesh."""
        return self._coordinate[self._axis(dim, allow_none=True)]

    def get_group(self, dim: int | str | None = None) -> Group:
        """The platform process group along ``dim`` through this rank (``dim`` may be omitted on a
        1-D mesh)."""
        return self._groups[self._axis(dim, allow_none=True)]

    def get_rank_list(self, dim: int | str | None = None) -> list[int]:
        """Global ranks of this rank's group along ``dim``, in group rank order."""
        axis = self._axis(dim, allow_none=True)
        coordinate = list(self._coordinate)
        ranks = []
        for i in range(self._shape[axis]):
            coordinate[axis] = i
            ranks.append(self._ranks[_ravel(coordinate, self._shape)])
        return ranks

    @property
    def rank_list(self) -> list[int]:
        """Global ranks of this 1-D mesh's group in group rank order (n-D: use
        :meth:`get_rank_list` with a dim)."""
        return self.get_rank_list()

    @property
    def mesh(self) -> list[Any]:
        """The global ranks as a nested list of ``shape`` (like ``torch``'s ``mesh.mesh.tolist()``)."""
        nested: list[Any] = list(self._ranks)
        for size in reversed(self._shape[1:]):
            nested = [nested[i : i + size] for i in range(0, len(nested), size)]
        return nested

    def __getitem__(self, name: str) -> DeviceMesh:
        """The 1-D mesh along the dim called ``name``, through this rank."""
        if not isinstance(name, str):
            raise TypeError(f"index a DeviceMesh by a mesh dim name, got {name!r}")
        axis = self._axis(name)
        return DeviceMesh(
            platform=self.platform,
            device_type=self.device_type,
            shape=(self._shape[axis],),
            ranks=self.get_rank_list(axis),
            groups=(self._groups[axis],),
            mesh_dim_names=(name,),
        )

    def __repr__(self) -> str:
        names = f", mesh_dim_names={self.mesh_dim_names}" if self.mesh_dim_names else ""
        return f"DeviceMesh({self.device_type!r}, {self.mesh}{names})"

    def _axis(self, dim: int | str | None, *, allow_none: bool = False) -> int:
        if dim is None:
            if allow_none and self.ndim == 1:
                return 0
            raise ValueError(
                f"this mesh has shape {self._shape} (dim names {self.mesh_dim_names}); name a mesh dim"
            )
        if isinstance(dim, str):
            if not self.mesh_dim_names or dim not in self.mesh_dim_names:
                raise KeyError(f"mesh dim {dim!r} is not one of mesh_dim_names={self.mesh_dim_names}")
            return self.mesh_dim_names.index(dim)
        if isinstance(dim, bool) or not isinstance(dim, int) or not -self.ndim <= dim < self.ndim:
            raise ValueError(f"mesh dim {dim!r} is out of range for a mesh of shape {self._shape}")
        return dim % self.ndim


def init_device_mesh(
    device_type: str, mesh_shape: Sequence[int], *, mesh_dim_names: Sequence[str] | None = None
) -> DeviceMesh:
    """Build a row-major mesh over all ranks of the default group and its process groups.

    Collective: every process calls it with the same arguments. The arguments are checked before
    any communication, so a bad shape raises ``ValueError`` on every rank and nobody hangs. Joins
    the default process group first if the platform has not (as torch's ``init_device_mesh``).

    Args:
        device_type: the hardware, ``"cpu"``, ``"cuda"`` or ``"npu"``; ``HP_PLATFORM`` names the
            framework. Without it, torch with gloo / NCCL / HCCL; under ``HP_PLATFORM=mindspore``,
            ``"cpu"`` is MindSpore with MCCL and ``"npu"`` MindSpore on Ascend with HCCL.
            ``"mindspore"`` is MindSpore on its current device target. A device the chosen
            framework cannot serve (``"cuda"`` under ``HP_PLATFORM=mindspore``, ``"npu"`` under
            ``HP_PLATFORM=cpu``) is a ``ValueError`` (see
            :func:`hyperpar_gdn.platform.resolve_device_type`).
        mesh_shape: ranks per mesh dim; their product must equal the world size.
        mesh_dim_names: one distinct name per mesh dim.

    Every process creates every group (``len(mesh_shape)`` families of ``world / size(dim)``
    groups), dim by dim, in row-major order.
    """
    shape = tuple(mesh_shape)
    if not shape or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in shape):
        raise ValueError(f"mesh_shape={shape} must be a non-empty sequence of positive ints")
    names = _check_names(mesh_dim_names, shape)
    platform = platform_for_device(device_type)
    world = platform.world_size()
    if math.prod(shape) != world:
        raise ValueError(f"mesh_shape={shape} holds {math.prod(shape)} ranks but the world size is {world}")
    if not platform.is_initialized():
        platform.init_distributed()
    me = platform.rank()
    groups: list[Group] = []
    for axis in range(len(shape)):
        mine = None
        others = [range(s) if d != axis else range(1) for d, s in enumerate(shape)]
        for base in itertools.product(*others):
            coordinate = list(base)
            line = []
            for i in range(shape[axis]):
                coordinate[axis] = i
                line.append(_ravel(coordinate, shape))
            group = platform.new_group(line)
            if me in line:
                mine = group
        groups.append(mine)
    return DeviceMesh(
        platform=platform,
        device_type=device_type,
        shape=shape,
        ranks=range(world),
        groups=groups,
        mesh_dim_names=names,
    )


def as_cp_mesh(mesh: Any) -> DeviceMesh:
    """The 1-D :class:`DeviceMesh` for context parallelism from ``mesh``: our 1-D DeviceMesh
    (returned as is) or a 1-D ``torch.distributed.device_mesh.DeviceMesh`` (such as
    ``torch_mesh["cp"]``), wrapped around its process group without communication.

    Raises ``ValueError`` for a mesh that is not 1-D (naming its shape) and ``TypeError`` for
    anything else.
    """
    if isinstance(mesh, DeviceMesh):
        if mesh.ndim != 1:
            raise ValueError(
                f"context parallelism needs a 1-D mesh; got shape {mesh.shape} with dim names "
                f"{mesh.mesh_dim_names}: pass one axis, e.g. mesh['cp']"
            )
        return mesh
    device_type = getattr(mesh, "device_type", None)
    platform = get_platform(device_type if device_type in _TORCH_DEVICE_TYPES else None)
    adopted = platform.adopt_mesh(mesh)
    if adopted is None:
        raise TypeError(
            f"expected a hyperpar_gdn DeviceMesh or a 1-D mesh of platform {platform.name!r}, "
            f"got {type(mesh).__module__}.{type(mesh).__qualname__}"
        )
    group, ranks, name = adopted
    return DeviceMesh.from_group(platform, group, ranks, mesh_dim_name=name, device_type=device_type)


def _check_names(names: Sequence[str] | None, shape: tuple[int, ...]) -> tuple[str, ...] | None:
    if names is None:
        return None
    if isinstance(names, str):
        raise ValueError(f"mesh_dim_names={names!r} must be a sequence of names, e.g. ({names!r},)")
    names = tuple(names)
    if len(names) != len(shape):
        raise ValueError(
            f"mesh_dim_names={names} has {len(names)} names but mesh_shape={shape} has {len(shape)} dims"
        )
    if len(set(names)) != len(names) or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"mesh_dim_names={names} must be distinct non-empty strings")
    return names


def _ravel(coordinate: Sequence[int], shape: tuple[int, ...]) -> int:
    index = 0
    for c, s in zip(coordinate, shape, strict=True):
        index = index * s + c
    return index


def _unravel(index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    coordinate = []
    for s in reversed(shape):
        index, c = divmod(index, s)
        coordinate.append(c)
    return tuple(reversed(coordinate))
