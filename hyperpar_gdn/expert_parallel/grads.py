"""The EP axis of a training mesh and the gradient sync of an expert-parallel model (torch).

The launched ranks form a mesh ``(dp, cp, tp)`` (tp innermost). Expert parallelism takes ``ep``
ranks that hold different tokens: consecutive ranks of the flattened data-parallel x CP axis at one
TP index (:func:`expert_mesh`: the mesh ``(dp cp / ep, ep, tp)`` over the same ranks, axes
``ep_replica``, ``ep``, ``tp``). So ep = cp is the CP group, ep = dp x cp every rank of a TP index;
the ``ep_replica`` ranks hold the same experts.

Gradients without FSDP (:func:`sync_expert_parallel_grads`): every parameter but the routed
experts as :func:`~hyperpar_gdn.distributed.grads.sync_context_parallel_grads` does (summed over
cp, averaged over dp); the routed experts' (each rank's experts, whole over its EP group's tokens)
summed over ``ep_replica`` and divided by dp: the same mean over the global batch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from hyperpar_gdn.distributed.grads import sync_context_parallel_grads
from hyperpar_gdn.distributed.mesh import DeviceMesh, init_device_mesh
from hyperpar_gdn.expert_parallel.style import EP_RECORD

__all__ = [
    "EXPERT_MESH_AXES",
    "expert_mesh",
    "expert_mesh_shape",
    "expert_parameters",
    "sync_expert_parallel_grads",
]

EXPERT_MESH_AXES = ("ep_replica", "ep", "tp")


def expert_mesh(shape: tuple[int, int, int], ep: int, *, device_type: str) -> DeviceMesh:
    """Collective: the mesh ``(dp cp / ep, ep, tp)`` (axes ``ep_replica``, ``ep``, ``tp``) over the
    ranks of the ``(dp, cp, tp)`` mesh ``shape``; ``ep`` must divide dp x cp."""
    return init_device_mesh(device_type, expert_mesh_shape(shape, ep), mesh_dim_names=EXPERT_MESH_AXES)


def expert_mesh_shape(shape: tuple[int, int, int], ep: int) -> tuple[int, int, int]:
    """``(dp cp / ep, ep, tp)`` of the ``(dp, cp, tp)`` mesh ``shape`` (``ValueError`` unless ``ep``
    divides dp x cp)."""
    dp, cp, tp = shape
    if ep < 1 or (dp * cp) % ep:
        raise ValueError(
            f"ep={ep} must divide the data-parallel x CP ranks dp x cp = {dp} x {cp} (expert parallelism "
            "spans ranks that hold different tokens)"
        )
    return dp * cp // ep, ep, tp


def expert_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The routed experts' parameters of every expert-parallel MoE block of ``model``."""
    return [
        p
        for m in model.modules()
        if getattr(m, EP_RECORD, None) is not None
        for p in (m.experts.gate_up_proj, m.experts.down_proj)
    ]


def sync_expert_parallel_grads(model: torch.nn.Module, mesh: Any, ep_mesh: DeviceMesh) -> None:
    """In place, without FSDP: the gradients of the one-device mean loss over the global batch.

    ``mesh``: the training mesh with axes ``dp`` and ``cp``; ``ep_mesh``: :func:`expert_mesh`'s."""
    experts = {id(p) for p in expert_parameters(model)}
    params = [p for p in model.parameters() if p.requires_grad]
    for chosen, reduce in ((False, _dense), (True, _experts)):
        group = [p for p in params if (id(p) in experts) == chosen]
        if not group:
            continue
        local = [torch.zeros_like(_local(p)) if p.grad is None else _local(p.grad) for p in group]
        for p, g in zip(group, reduce(local, mesh, ep_mesh), strict=True):
            p.grad = (
                DTensor.from_local(g, p.device_mesh, p.placements, run_check=False)
                if isinstance(p, DTensor)
                else g
            )


def _dense(grads: list[torch.Tensor], mesh: Any, ep_mesh: DeviceMesh) -> list[torch.Tensor]:
    return sync_context_parallel_grads(grads, mesh, dp_axis="dp")


def _experts(grads: list[torch.Tensor], mesh: Any, ep_mesh: DeviceMesh) -> list[torch.Tensor]:
    dp = mesh["dp"].size()
    replicas = ep_mesh["ep_replica"]
    flat = torch.cat([g.reshape(-1) for g in grads])
    if replicas.size() > 1:
        flat = replicas.platform.collectives.all_reduce_sum(flat, replicas.get_group())
    flat = flat / dp
    return [
        piece.reshape(g.shape) for g, piece in zip(grads, flat.split([g.numel() for g in grads]), strict=True)
    ]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
