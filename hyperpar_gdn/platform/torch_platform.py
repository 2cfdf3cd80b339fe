"""The PyTorch platform: CPU (gloo), CUDA (NCCL) and Ascend NPU (HCCL through torch-npu).

``torch_npu`` is imported only when the ``npu`` platform is constructed, never at import time:
once installed it changes what a plain ``import torch`` does, and it cannot be imported on a
machine without Ascend CANN.

Process groups come from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``). Without ``RANK`` and ``WORLD_SIZE`` a single process joins a
1-rank group backed by an in-memory store, so collectives over ``group=None`` work unchanged.

Restarts (``torchrun --max-restarts``): the workers of every attempt meet in the torchrun agent's
store (``TORCHELASTIC_USE_AGENT_STORE=True``), which outlives the attempts and keeps the keys of
the ones before: peer addresses of processes that are gone. Every key the process groups write
is therefore put under a prefix named for the attempt (``TORCHELASTIC_RESTART_COUNT``), so each
attempt's groups (the default one and every group made from it) rendezvous afresh.

Example::

    platform = TorchPlatform("cpu")
    platform.init_distributed(timeout_s=60)
    group = platform.new_group([0, 1])     # every process calls this, in the same order
    y = platform.collectives.all_gather(x, group)
    platform.destroy()
"""

from __future__ import annotations

import atexit
import gc
import importlib
import itertools
import os
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hyperpar_gdn.platform.base import Group, Platform, PlatformUnavailableError
from hyperpar_gdn.platform.device_trace import traced
from hyperpar_gdn.platform.torch_collectives import TorchCollectives
from hyperpar_gdn.platform.torch_ops import TorchOps

_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


@atexit.register
def _collect_before_exit() -> None:
    """Free what only reference cycles keep alive (a model whose installed forwards refer back to
    it, with its meshes and their process groups) while Python is still whole: left to the
    interpreter's shutdown, a gloo process group's teardown can abort the process on its way out
    ("terminate called without an active exception") after a run that succeeded."""
    gc.collect()


_LAUNCH_VARS = ("RANK", "WORLD_SIZE")


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def _elastic_attempt_store(timeout: timedelta) -> dist.Store | None:
    """Under a torchrun agent whose store the workers share across restarts, a client of that
    store whose keys live under this attempt's own prefix; ``None`` otherwise (``env://`` as is).

    The prefix holds ``TORCHELASTIC_RUN_ID`` and ``TORCHELASTIC_RESTART_COUNT``, which every
    worker of an attempt shares on one node (one agent). Agents on several nodes of a c10d
    rendezvous can count restarts differently; ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` gives each
    attempt a new store there (and this returns None). The store client waits at most ``timeout``
    for the store and for every key.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    attempt = _env_int("TORCHELASTIC_RESTART_COUNT", 0)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
    store.set_timeout(timeout)
    return dist.PrefixStore(f"hyperpar_gdn/{run_id}/attempt_{attempt}/default_pg", store)


class TorchPlatform(Platform):
    """PyTorch on ``name`` = ``"cpu"``, ``"cuda"`` or ``"npu"``.

    Attributes:
        name: the platform name.
        backend: the process-group backend (``gloo``, ``nccl`` or ``hccl``).
        ops: tensor functions (:class:`TorchOps`).
        collectives: differentiable collectives (:class:`TorchCollectives`).
    """

    def __init__(self, name: str) -> None:
        if name not in _BACKENDS:
            raise ValueError(
                f"TorchPlatform name {name!r} is unknown; valid values are {', '.join(_BACKENDS)}"
            )
        self.name = name
        self.backend = _BACKENDS[name]
        if name == "npu":
            try:
                importlib.import_module("torch_npu")
            except ImportError as err:
                raise PlatformUnavailableError(
                    "platform 'npu' needs torch_npu (and Ascend CANN); importing it failed: " + str(err)
                ) from err
        elif name == "cuda" and not torch.cuda.is_available() and not traced(name):
            raise PlatformUnavailableError(
                "platform 'cuda' (HP_PLATFORM=cuda or device 'cuda') needs a CUDA device, but "
                "torch.cuda.is_available() is False on this machine; use the CPU (HP_PLATFORM=cpu, --device cpu)"
            )
        self.ops = TorchOps()
        self.collectives = TorchCollectives()
        # the collectives' own tensors (all_gather_int) go to this process's device, also when
        # another library joined the process group (NCCL and HCCL refuse CPU tensors)
        self.collectives.device = self.device

    def __repr__(self) -> str:
        return f"TorchPlatform({self.name!r})"

    # --- device -----------------------------------------------------------------------------------
    @property
    def local_rank(self) -> int:
        """``LOCAL_RANK`` from the launcher (0 when unset)."""
        return _env_int("LOCAL_RANK", 0)

    @property
    def device(self) -> torch.device:
        """This process's device: index ``LOCAL_RANK`` among the visible ones, or index 0 when the
        launcher made only one device visible to each process (``CUDA_VISIBLE_DEVICES`` or
        ``ASCEND_RT_VISIBLE_DEVICES`` per process)."""
        if self.name == "cpu":
            return torch.device("cpu")
        if traced(self.name):  # a trace without the device: no device count to read
            return torch.device(self.name, self.local_rank)
        count = torch.cuda.device_count() if self.name == "cuda" else torch.npu.device_count()  # type: ignore[attr-defined]
        if count == 1:
            return torch.device(self.name, 0)
        if not 0 <= self.local_rank < count:
            raise ValueError(
                f"LOCAL_RANK={self.local_rank} but this process sees {count} {self.name} devices; "
                "give each process one visible device or launch at most that many processes per node"
            )
        return torch.device(self.name, self.local_rank)

    def _set_device(self) -> None:
        if traced(self.name):  # a trace without the device (device_trace.py): nothing to select
            return
        if self.name == "cuda":
            torch.cuda.set_device(self.device)
        elif self.name == "npu":
            torch.npu.set_device(self.device)  # type: ignore[attr-defined]

    # --- process groups ---------------------------------------------------------------------------
    def init_distributed(self, *, timeout_s: float = 600.0, store: dist.Store | None = None) -> None:
        """Join the default process group (idempotent).

        With ``RANK`` and ``WORLD_SIZE`` set (torchrun), rendezvous through ``env://``
        (``MASTER_ADDR``/``MASTER_PORT``), or through ``store`` when one is given (a c10d store
        shared by the ranks, e.g. a ``FileStore``: the test harness uses one). With neither set,
        start a 1-rank group on an in-memory store. ``timeout_s`` bounds every collective and the
        rendezvous.
        """
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be positive")
        if dist.is_initialized():
            current = dist.get_backend()
            if current != self.backend and not traced(self.name):
                raise RuntimeError(
                    f"a default process group with backend {current!r} already exists; "
                    f"platform {self.name!r} needs {self.backend!r}"
                )
            return
        self._set_device()
        timeout = timedelta(seconds=timeout_s)
        self.collectives.timeout = timeout  # point-to-point waits honour it too
        self.collectives.device = self.device
        present = [var for var in _LAUNCH_VARS if os.environ.get(var, "").strip()]
        device_id = None if self.name == "cpu" else self.device  # binds NCCL/HCCL to it eagerly
        if len(present) == len(_LAUNCH_VARS) and store is not None:
            rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
            dist.init_process_group(
                self.backend, store=store, rank=rank, world_size=world, timeout=timeout, device_id=device_id
            )
        elif len(present) == len(_LAUNCH_VARS) and (attempt := _elastic_attempt_store(timeout)) is not None:
            rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
            dist.init_process_group(
                self.backend, store=attempt, rank=rank, world_size=world, timeout=timeout, device_id=device_id
            )
        elif len(present) == len(_LAUNCH_VARS):
            dist.init_process_group(self.backend, init_method="env://", timeout=timeout, device_id=device_id)
        elif not present:
            dist.init_process_group(
                self.backend,
                store=store if store is not None else dist.HashStore(),
                rank=0,
                world_size=1,
                timeout=timeout,
                device_id=device_id,
            )
        else:
            missing = [var for var in _LAUNCH_VARS if var not in present]
            raise ValueError(
                f"launcher environment is incomplete: {', '.join(present)} set but {', '.join(missing)} "
                "missing; set both (torchrun does) or neither (single process)"
            )

    def is_initialized(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def rank(self) -> int:
        """Global rank; before :meth:`init_distributed`, ``RANK`` from the environment (or 0)."""
        return dist.get_rank() if self.is_initialized() else _env_int("RANK", 0)

    def world_size(self) -> int:
        """World size; before :meth:`init_distributed`, ``WORLD_SIZE`` from the environment (or 1)."""
        return dist.get_world_size() if self.is_initialized() else _env_int("WORLD_SIZE", 1)

    def new_group(self, ranks: Sequence[int]) -> Group:
        """A process group over global ``ranks``, given in ascending order (torch orders group
        ranks by global rank, so group rank i is ``ranks[i]``; an unsorted list is an error rather
        than a silent reordering).

        Collective: every process of the default group calls it with the same ``ranks``, in the
        same order, members or not. Non-members get a handle they must not use.
        """
        if not self.is_initialized():
            raise RuntimeError(f"new_group({list(ranks)}) needs init_distributed() first")
        ranks = [int(r) for r in ranks]
        world = self.world_size()
        if (
            not ranks
            or ranks[0] < 0
            or ranks[-1] >= world
            or any(a >= b for a, b in itertools.pairwise(ranks))
        ):
            raise ValueError(f"new_group ranks={ranks} must be distinct ranks in [0, {world}), ascending")
        return dist.new_group(ranks=ranks)

    def destroy(self) -> None:
        """Destroy the default process group and every group created from it."""
        if self.is_initialized():
            dist.destroy_process_group()

    # --- torch DeviceMesh interop -------------------------------------------------------------------
    def adopt_mesh(self, obj: object) -> tuple[Group, list[int], str | None] | None:
        """``(group, global ranks in group order, axis name)`` of a 1-D
        ``torch.distributed.device_mesh.DeviceMesh`` (or a named 1-D slice of one); ``None`` when
        ``obj`` is not a torch DeviceMesh. Raises ``ValueError`` for a mesh that is not 1-D.
        """
        from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh

        if not isinstance(obj, TorchDeviceMesh):
            return None
        if obj.ndim != 1:
            raise ValueError(
                f"a torch DeviceMesh of shape {tuple(obj.shape)} (dim names {obj.mesh_dim_names}) is not "
                "1-D; pass the context-parallel axis, e.g. mesh['cp']"
            )
        group = obj.get_group()
        names = obj.mesh_dim_names
        return group, dist.get_process_group_ranks(group), names[0] if names else None

    # --- helpers for scripts and checks ----------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def from_numpy(self, array: Any, *, dtype: str = "float32") -> torch.Tensor:
        return torch.as_tensor(np.asarray(array)).to(device=self.device, dtype=getattr(torch, dtype))

    def to_numpy(self, x: torch.Tensor) -> np.ndarray:
        x = x.detach().cpu()
        return (x.float() if x.dtype == torch.bfloat16 else x).numpy()

    def value_and_grads(
        self,
        fn: Callable[..., torch.Tensor],
        inputs: Sequence[torch.Tensor],
        cotangent: torch.Tensor,
        module: Any,
    ) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]:
        inputs = [x.detach().requires_grad_(True) for x in inputs]
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        out = fn(*inputs)
        grads = torch.autograd.grad(out, [*inputs, *(p for _, p in named)], cotangent, allow_unused=True)
        param_grads = {
            name: torch.zeros_like(p) if g is None else g
            for (name, p), g in zip(named, grads[len(inputs) :], strict=True)
        }
        return out.detach(), list(grads[: len(inputs)]), param_grads
