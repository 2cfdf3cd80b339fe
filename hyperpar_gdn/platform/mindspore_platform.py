"""The MindSpore platform: MindSpore 2.10 in PyNative mode, MCCL on CPU and HCCL on Ascend.

Processes come from ``msrun`` (or any launcher that sets MindSpore's ``MS_ROLE``/``MS_SCHED_*``
variables, or an Ascend rank table)::

    HP_PLATFORM=mindspore msrun --worker_num=4 --local_worker_num=4 --master_port=8118 \\
        --join=True --log_dir=msrun_log scripts/selfcheck.py

Without a launcher's variables a single process runs as a 1-rank world: no communication library
is started and every collective over the world is a local copy, so the same code runs unchanged.

MindSpore 2.10 habits the platform absorbs here, and nowhere else (docs/backends.md has the
measurements):

- The functions in ``mindspore.ops.communication`` look up this process's rank in the group
  ``hccl_world_group`` whatever the device, but on CPU the world group is ``mccl_world_group``:
  ``send``, ``isend`` and the list ``all_gather`` fail there with "The group hccl_world_group does
  not exist". :meth:`MindSporePlatform.init_distributed` creates a group of that name over the
  whole world on CPU, and the collectives always pass their group explicitly.
- ``create_group`` must be called by the members of the new group only (a non-member's call fails
  and leaves the process unable to communicate).
- A collective waiting for a peer that never comes fails after ``MS_CPU_COMM_OP_TIMEOUT`` seconds
  on CPU (``HCCL_EXEC_TIMEOUT`` on Ascend); ``init_distributed(timeout_s=...)`` sets it unless the
  environment already does. ``msrun --join=True`` kills every worker once one exits non-zero.
- MCCL cannot be initialised twice in one process: after :meth:`MindSporePlatform.destroy` this
  process cannot join a group again.
- MindSpore's CPU thread pool ignores ``OMP_NUM_THREADS`` and spreads a worker over every free
  core; on CPU :meth:`MindSporePlatform.init_distributed` gives each worker its share of the
  cores first (:mod:`.mindspore_cpu_share`).
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import mindspore as ms
import mindspore.communication as ms_comm
import numpy as np

from hyperpar_gdn.platform.base import Group, Platform
from hyperpar_gdn.platform.mindspore_collectives import MindSporeCollectives, MindSporeGroup
from hyperpar_gdn.platform.mindspore_cpu_share import (
    CpuShare,
    apply_cpu_share,
    plan_cpu_share,
    read_cpu_share_env,
)
from hyperpar_gdn.platform.mindspore_ops import MindSporeOps, enable_launch_blocking

__all__ = ["MindSporeGroup", "MindSporePlatform"]

# The group name 2.10's communication functions assume (mindspore.ops.communication).
_ASSUMED_WORLD_GROUP = "hccl_world_group"
_LAUNCH_VARS = ("MS_WORKER_NUM", "MS_SCHED_HOST", "MS_SCHED_PORT")
_TIMEOUT_VARS = {"CPU": "MS_CPU_COMM_OP_TIMEOUT", "Ascend": "HCCL_EXEC_TIMEOUT"}
_DTYPES = {
    "float16": ms.float16,
    "float32": ms.float32,
    "float64": ms.float64,
    "bfloat16": ms.bfloat16,
    "int8": ms.int8,
    "int16": ms.int16,
    "int32": ms.int32,
    "int64": ms.int64,
    "uint8": ms.uint8,
    "bool": ms.bool_,
}


def _env_int(*names: str, default: int) -> int:
    """The first of ``names`` set in the environment, as an int; ``default`` if none is."""
    for name in names:
        value = os.environ.get(name, "").strip()
        if value:
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"environment variable {name}={value!r} is not an integer") from None
    return default


class MindSporePlatform(Platform):
    """MindSpore on CPU (MCCL) or Ascend (HCCL), PyNative mode.

    Args:
        device_target: ``"CPU"`` or ``"Ascend"``; default: MindSpore's current device target.

    Attributes:
        name: ``"mindspore"``.
        device_target: the MindSpore device target.
        ops: tensor functions (:class:`MindSporeOps`).
        collectives: differentiable collectives (:class:`MindSporeCollectives`).

    Example::

        platform = MindSporePlatform()
        platform.init_distributed(timeout_s=60)     # under msrun: joins the MCCL/HCCL world
        group = platform.new_group([0, 1])          # members' handle; every process calls it
        y = platform.collectives.all_gather(x, group)
        platform.destroy()
    """

    name = "mindspore"

    def __init__(self, device_target: str | None = None) -> None:
        target = str(device_target if device_target is not None else ms.get_context("device_target"))
        if target not in ("CPU", "Ascend"):
            raise ValueError(
                f"MindSporePlatform device_target={target!r} is not supported; use 'CPU' or 'Ascend'"
            )
        self.device_target = target
        self.ops = MindSporeOps(target)
        self.collectives = MindSporeCollectives(native_all_to_all=target == "Ascend")
        self._world: MindSporeGroup | None = None
        self._rank = 0
        self._groups: dict[tuple[int, ...], MindSporeGroup] = {}
        self._communicating = False  # the communication library was initialised
        self._released = False
        self.cpu_share: CpuShare | None = None  # what init_distributed set (CPU only)

    def __repr__(self) -> str:
        return f"MindSporePlatform({self.device_target!r})"

    # --- device -------------------------------------------------------------------------------
    @property
    def local_rank(self) -> int:
        """This process's rank on its node (0 without a launcher)."""
        if self._communicating:
            return int(ms_comm.get_local_rank())
        return _env_int("LOCAL_RANK", "DEVICE_ID", default=0)

    @property
    def device(self) -> str:
        """``"CPU"``, or ``"Ascend:<local rank>"``."""
        return "CPU" if self.device_target == "CPU" else f"Ascend:{self.local_rank}"

    # --- process groups -------------------------------------------------------------------------
    def init_distributed(self, *, timeout_s: float = 600.0) -> None:
        """Join the world (idempotent) and switch MindSpore to PyNative mode.

        Under ``msrun`` (``MS_ROLE``, ``MS_WORKER_NUM``, ``MS_SCHED_HOST``, ``MS_SCHED_PORT``) or an
        Ascend rank table (``RANK_TABLE_FILE``), initialise MCCL/HCCL; with none of those, a 1-rank
        local world. ``timeout_s`` becomes ``MS_CPU_COMM_OP_TIMEOUT`` (CPU) or
        ``HCCL_EXEC_TIMEOUT`` (Ascend), seconds, unless that variable is already set: how long a
        collective waits for its peers before it fails.

        On CPU it also gives each worker its share of the machine before the first kernel: its
        kernel threads and, under a launcher with several workers on this node, its own cores
        (``HP_MINDSPORE_THREADS``, ``HP_MINDSPORE_BIND``; :mod:`.mindspore_cpu_share` has the
        rules). What it set is in :attr:`cpu_share`.
        """
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be positive")
        if self._world is not None:
            return
        if self.device_target == "CPU":
            read_cpu_share_env(os.environ)  # a bad value fails here, before any communication
        if self._released:
            raise RuntimeError(
                "MindSpore cannot initialise its communication library twice in one process; "
                "this platform was destroyed: start a new process"
            )
        ms.set_context(mode=ms.PYNATIVE_MODE)
        if self.device_target == "CPU" and str(ms.get_context("device_target")) != "CPU":
            ms.set_device("CPU")  # init_device_mesh("cpu") on a machine whose default is Ascend
        if self.device_target == "CPU":  # small ops run faster so on CPU; on Ascend it would
            enable_launch_blocking()  # make every kernel synchronous
        role = os.environ.get("MS_ROLE", "").strip()
        rank_table = os.environ.get("RANK_TABLE_FILE", "").strip()
        present = [var for var in _LAUNCH_VARS if os.environ.get(var, "").strip()]
        if role and len(present) != len(_LAUNCH_VARS):
            missing = [var for var in _LAUNCH_VARS if var not in present]
            raise ValueError(
                f"launcher environment is incomplete: MS_ROLE={role!r} set but {', '.join(missing)} "
                "missing; launch with msrun (it sets them all) or unset MS_ROLE for one process"
            )
        if not role and not rank_table:
            if present:
                raise ValueError(
                    f"launcher environment is incomplete: {', '.join(present)} set but MS_ROLE missing; "
                    "launch with msrun or unset them for one process"
                )
            self._share_cpus(launched=False, local_rank=0, local_size=1)
            self._bind(MindSporeGroup("local_world", (0,), local=True), rank=0)
            return
        os.environ.setdefault(_TIMEOUT_VARS[self.device_target], str(math.ceil(timeout_s)))
        if self.device_target == "Ascend":
            ms.set_device("Ascend")
        ms_comm.init()  # the scheduler process (MS_ROLE=MS_SCHED) never returns from here
        self._communicating = True
        self._share_cpus(
            launched=True,
            local_rank=int(ms_comm.get_local_rank()),
            local_size=int(ms_comm.get_local_rank_size()),
        )
        world_name = ms_comm.GlobalComm.WORLD_COMM_GROUP
        world = int(ms_comm.get_group_size())
        if world_name != _ASSUMED_WORLD_GROUP:
            ms_comm.create_group(_ASSUMED_WORLD_GROUP, list(range(world)))
        self._bind(MindSporeGroup(world_name, tuple(range(world))), rank=int(ms_comm.get_rank()))

    def _share_cpus(self, *, launched: bool, local_rank: int, local_size: int) -> None:
        """On CPU, this worker's threads and cores (:mod:`.mindspore_cpu_share`)."""
        if self.device_target != "CPU":
            return
        share = plan_cpu_share(
            environ=os.environ,
            usable_cpus=sorted(os.sched_getaffinity(0)),
            online_cpus=os.cpu_count() or 1,
            local_rank=local_rank,
            local_size=local_size,
            launched=launched,
        )
        self.cpu_share = apply_cpu_share(share)

    def _bind(self, world: MindSporeGroup, *, rank: int) -> None:
        self._world = world
        self._rank = rank
        self._groups = {world.ranks: world}
        self.collectives.bind(world, rank)

    def is_initialized(self) -> bool:
        return self._world is not None

    def rank(self) -> int:
        """Global rank; before :meth:`init_distributed`, ``RANK_ID`` from the environment (or 0)."""
        return self._rank if self._world is not None else _env_int("RANK_ID", "RANK", default=0)

    def world_size(self) -> int:
        """World size; before :meth:`init_distributed`, ``MS_WORKER_NUM`` or ``RANK_SIZE`` from the
        environment (or 1)."""
        if self._world is not None:
            return self._world.size
        return _env_int("MS_WORKER_NUM", "RANK_SIZE", default=1)

    def new_group(self, ranks: Sequence[int]) -> Group:
        """A :class:`MindSporeGroup` over global ``ranks``, given in ascending order (group rank i
        is ``ranks[i]``).

        Every process calls it with the same ``ranks`` in the same order, members or not (as with
        torch); only members create the MindSpore group (MindSpore requires that), non-members get
        a handle that the collectives refuse. The same ranks twice give the same group.
        """
        if self._world is None:
            raise RuntimeError(f"new_group({list(ranks)}) needs init_distributed() first")
        ranks = tuple(int(r) for r in ranks)
        world = self._world.size
        if (
            not ranks
            or ranks[0] < 0
            or ranks[-1] >= world
            or any(a >= b for a, b in itertools.pairwise(ranks))
        ):
            raise ValueError(
                f"new_group ranks={list(ranks)} must be distinct ranks in [0, {world}), ascending"
            )
        if ranks in self._groups:
            return self._groups[ranks]
        group = MindSporeGroup("hp_group_" + "_".join(map(str, ranks)), ranks)
        if self._rank in ranks:
            ms_comm.create_group(group.name, list(ranks))
        self._groups[ranks] = group
        return group

    def destroy(self) -> None:
        """Destroy the groups this platform created and release the communication library (final:
        MindSpore cannot initialise it again in this process)."""
        if self._world is None:
            return
        if self._communicating:
            # A group of one rank never gets a device communicator (nothing to exchange): MindSpore's
            # destroy_group of one logs "Failed to destroy device communication group"; release()
            # ends it with the rest. Newest first, as they were built on each other.
            for group in reversed(list(self._groups.values())):
                if group is not self._world and self._rank in group.ranks and len(group.ranks) > 1:
                    ms_comm.destroy_group(group.name)
            ms_comm.release()
            self._communicating = False
            self._released = True
        self._world = None
        self._groups = {}
        self.collectives.unbind()

    # --- helpers for scripts and checks ----------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        ms.set_seed(int(seed))

    def from_numpy(self, array: Any, *, dtype: str = "float32") -> ms.Tensor:
        """A MindSpore tensor of ``array`` in ``dtype`` (``"float32"``, ``"float64"``,
        ``"bfloat16"``, ``"float16"``, ``"int8"``..``"int64"``, ``"uint8"``, ``"bool"``)."""
        if dtype not in _DTYPES:
            raise ValueError(f"dtype={dtype!r} is not supported; valid names are {', '.join(_DTYPES)}")
        array = np.asarray(array)
        if dtype == "bfloat16":  # numpy has no bfloat16: go through float32
            return ms.Tensor(np.ascontiguousarray(array, dtype=np.float32)).astype(ms.bfloat16)
        return ms.Tensor(np.ascontiguousarray(array, dtype=np.dtype(dtype)))

    def to_numpy(self, x: ms.Tensor) -> np.ndarray:
        """A numpy copy of ``x`` (bfloat16 becomes float32)."""
        if x.dtype == ms.bfloat16:
            x = x.astype(ms.float32)
        return np.array(x.asnumpy(), copy=True)

    def value_and_grads(
        self,
        fn: Callable[..., ms.Tensor],
        inputs: Sequence[ms.Tensor],
        cotangent: ms.Tensor,
        module: Any,
    ) -> tuple[ms.Tensor, list[ms.Tensor], dict[str, ms.Tensor]]:
        """``out = fn(*inputs)`` and the gradients of ``sum(out * cotangent)`` with respect to
        ``inputs`` and to the trainable parameters of the ``mindspore.nn.Cell`` ``module``, named
        relative to ``module`` (``"in_proj_qkv.weight"``, ``"A_log"``: no prefix of a parent cell).
        """
        if not inputs:
            raise ValueError("value_and_grads needs at least one input to differentiate")
        named = [(name, p) for name, p in module.parameters_and_names() if p.requires_grad]
        positions = tuple(range(len(inputs)))
        weights = [p for _, p in named] or None
        grad_fn = ms.value_and_grad(fn, grad_position=positions, weights=weights, sens_param=True)
        out, grads = grad_fn(*inputs, cotangent)
        input_grads, param_grads = grads if weights is not None else (grads, ())
        if not isinstance(input_grads, (tuple, list)):
            input_grads = (input_grads,)
        return (
            out,
            list(input_grads),
            {name: grad for (name, _), grad in zip(named, param_grads, strict=True)},
        )
