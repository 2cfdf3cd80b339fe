"""The gradient step of a context-parallel training loop: sum the ranks' gradient shares.

Under context parallelism every rank of a CP group holds the whole model and computes the
gradient of its own loss term (its tokens' share of the global mean, as
:func:`~hyperpar_gdn.context_parallel_loss` or a transformers model's ``labels=`` gives it). The
gradient of the whole loss is the sum of these shares over the CP group; with data parallelism on
top, the mean of the replicas' sums. FSDP2 does both in its reduce-scatter; without it, call

    loss.backward()
    sync_context_parallel_grads(model, mesh)               # torch: in place, before optimizer.step()
    grads = sync_context_parallel_grads(grads, mesh)       # MindSpore: the list value_and_grad gave

One flat all-reduce per dtype and mesh axis, not one per parameter.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hyperpar_gdn.distributed.mesh import DeviceMesh, as_cp_mesh
from hyperpar_gdn.platform import Tensor

__all__ = ["sync_context_parallel_grads"]


def sync_context_parallel_grads(
    model_or_grads: Any, mesh: Any, *, cp_axis: str = "cp", dp_axis: str | None = None
) -> Any:
    """Sum the gradients over the CP group (then average them over ``dp_axis``, if given).

    Args:
        model_or_grads: a torch module whose parameters' ``.grad`` are summed in place (a
            parameter without a gradient counts as zeros and gets the sum), or a sequence of
            gradient tensors (MindSpore's ``value_and_grad`` output, any framework), returned
            summed as a new list in the same order.
        mesh: the 1-D CP mesh (``mesh["cp"]``), or a mesh with named axes holding ``cp_axis``
            (and ``dp_axis``); ours or a torch ``DeviceMesh``.
        cp_axis: the CP axis of a mesh with named axes.
        dp_axis: a data-parallel axis to average over after the CP sum (a mesh with named axes).

    Returns ``model_or_grads`` (a module) or the summed gradients (a sequence).

    Do not call it under FSDP2 (``fully_shard``): its reduce-scatter already sums the gradients
    (their ``.grad`` are sharded DTensors, refused here).
    """
    cp_mesh, dp_mesh = _axes(mesh, cp_axis, dp_axis)
    if isinstance(model_or_grads, Sequence):
        return _reduce(list(model_or_grads), cp_mesh, dp_mesh)
    parameters = getattr(model_or_grads, "parameters", None)
    if parameters is None:
        raise TypeError(
            f"sync_context_parallel_grads takes a torch module or a sequence of gradients; got "
            f"{type(model_or_grads).__name__}"
        )
    params = [p for p in parameters() if getattr(p, "requires_grad", True)]
    sharded = sorted({type(p.grad).__name__ for p in params if p.grad is not None} - {"Tensor", "Parameter"})
    if sharded:
        raise ValueError(
            f"gradients of type {', '.join(sharded)} (FSDP's sharded gradients?): FSDP sums them over "
            "every rank itself; call sync_context_parallel_grads only without FSDP"
        )
    if not params:
        return model_or_grads
    xp = cp_mesh.platform.ops
    grads = [p.grad if p.grad is not None else xp.zeros(tuple(p.shape), like=p) for p in params]
    for p, g in zip(params, _reduce(grads, cp_mesh, dp_mesh), strict=True):
        p.grad = g
    return model_or_grads


def _axes(mesh: Any, cp_axis: str, dp_axis: str | None) -> tuple[DeviceMesh, DeviceMesh | None]:
    """(the CP mesh, the DP mesh or None); checked before any communication."""
    ndim = getattr(mesh, "ndim", 1)
    if ndim == 1:
        if dp_axis is not None:
            raise ValueError(
                f"dp_axis={dp_axis!r} needs a mesh with named axes; got a 1-D mesh "
                f"(names {getattr(mesh, 'mesh_dim_names', None)})"
            )
        return as_cp_mesh(mesh), None
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    for option, axis in (("cp_axis", cp_axis), ("dp_axis", dp_axis)):
        if axis is not None and axis not in names:
            raise ValueError(f"{option}={axis!r} is not an axis of the mesh; its axes are {names}")
    return as_cp_mesh(mesh[cp_axis]), None if dp_axis is None else as_cp_mesh(mesh[dp_axis])


def _reduce(grads: list[Tensor], cp_mesh: DeviceMesh, dp_mesh: DeviceMesh | None) -> list[Tensor]:
    """Sum over ``cp_mesh``, average over ``dp_mesh``: one flat all-reduce per dtype and axis."""
    xp = cp_mesh.platform.ops
    comm = cp_mesh.platform.collectives
    out: list[Tensor] = list(grads)
    by_dtype: dict[Any, list[int]] = {}
    for i, g in enumerate(grads):
        by_dtype.setdefault(xp.dtype(g), []).append(i)
    for indices in by_dtype.values():
        shapes = [tuple(grads[i].shape) for i in indices]
        sizes = [_numel(shape) for shape in shapes]
        flat = xp.cat([grads[i].reshape(-1) for i in indices], 0)
        if cp_mesh.size() > 1:
            flat = comm.all_reduce_sum(flat, cp_mesh.get_group())
        if dp_mesh is not None and dp_mesh.size() > 1:
            flat = comm.all_reduce_sum(flat, dp_mesh.get_group()) / dp_mesh.size()
        for i, shape, piece in zip(indices, shapes, xp.split(flat, sizes, 0), strict=True):
            out[i] = piece.reshape(shape)
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
