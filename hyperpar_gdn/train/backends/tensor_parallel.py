"""``--tp`` in the torch trainer: the model split over the TP axis of a ``(dp, cp, tp)`` mesh.

The world is a torch ``DeviceMesh`` ``(dp, cp, tp)``, tp innermost (the ranks of a TP group are
consecutive: the fastest links). :func:`apply_tp_option` checks the model against the library's
plan (one ``ValueError`` naming ``--tp``, on every rank, before the mesh exists) and applies
:func:`~hyperpar_gdn.tensor_parallel.apply_tensor_parallel` over ``mesh["tp"]``; context
parallelism then goes on over ``cp`` and FSDP over the flattened ``(dp, cp)`` axes of the same
mesh. Every TP rank of a CP rank gets the same shard of the batch and computes the same loss.

Without FSDP, :func:`~hyperpar_gdn.tensor_parallel.comm.sync_tp_grads` sums the gradient shares
over the CP group and averages them over the DP replicas, each TP rank its own shard.
"""

from __future__ import annotations

from typing import Any

import torch

from hyperpar_gdn.distributed.decoder_layers import text_model_of
from hyperpar_gdn.train.config import TrainConfig

__all__ = ["apply_tp_option"]


def apply_tp_option(
    model: torch.nn.Module, config: TrainConfig, *, shape: tuple[int, ...], device_type: str
) -> Any:
    """Split ``model``'s blocks over the TP axis of a new torch mesh of ``shape`` (dp, cp, tp) and
    return that mesh (collective: every rank builds it). A model the plan cannot split at ``--tp``
    is one ``ValueError`` on every rank before the mesh is built, the model as it was."""
    from torch.distributed.device_mesh import init_device_mesh

    from hyperpar_gdn.tensor_parallel import apply_tensor_parallel, tensor_parallel_plan

    try:
        tensor_parallel_plan(text_model_of(model), config.tp)  # the library's checks, no communication
    except ValueError as err:
        raise ValueError(f"--tp {config.tp} with {config.model_name}: {err}") from None
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=("dp", "cp", "tp"))
    apply_tensor_parallel(model, mesh["tp"])
    return mesh
