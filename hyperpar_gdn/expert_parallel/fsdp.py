"""FSDP2 over the routed experts of an expert-parallel model (torch).

Each EP rank holds its own ``E / ep`` experts; the ``ep_replica`` ranks of :func:`expert_torch_mesh`
(the dp x cp / ep ranks at one EP and TP index) hold the same ones. :func:`fully_shard_experts`
shards every expert-parallel block's experts over those replicas: ``[E / ep, 2I, C]`` and
``[E / ep, C, I]`` become DTensors on the 2-D mesh ``(ep_replica, ep)``, cut over the replicas by
expert where they divide ``E / ep``, else along dim 1 (FSDP cuts another dim only evenly). FSDP
gathers them over ``ep_replica`` for the forward (EP's dispatch runs on the gathered ``E / ep``
experts) and its reduce-scatter sums their gradients over ``ep_replica``, then they are divided
by dp: what :func:`~.grads.sync_expert_parallel_grads` does without FSDP. torch composes the two
only on axes of one torch mesh: the experts' EP axis must be ``expert_torch_mesh(...)["ep"]``.

Call it before ``fully_shard`` goes on the decoder layers and the model, which then leave the
experts to their own group and shard every other parameter over the data x CP ranks
(``apply_fsdp(..., expert_replicas=...)`` of :mod:`hyperpar_gdn.parallel.fsdp` does both).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from hyperpar_gdn.expert_parallel.grads import EXPERT_MESH_AXES, expert_mesh_shape
from hyperpar_gdn.expert_parallel.style import EP_RECORD, EXPERT_PARAMS

__all__ = ["expert_torch_mesh", "fully_shard_experts", "replica_cut", "replica_cut_error"]


def expert_torch_mesh(shape: tuple[int, int, int], ep: int, *, device_type: str) -> Any:
    """Collective: torch's ``DeviceMesh`` ``(dp cp / ep, ep, tp)`` (axes ``ep_replica``, ``ep``,
    ``tp``) over the ranks of the ``(dp, cp, tp)`` mesh ``shape``: the same ranks as
    :func:`~.grads.expert_mesh`; ``ep`` must divide dp x cp."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, expert_mesh_shape(shape, ep), mesh_dim_names=EXPERT_MESH_AXES)


def fully_shard_experts(
    model: torch.nn.Module, replicas: Any, *, dp: int, mp_policy: MixedPrecisionPolicy | None = None
) -> int:
    """``fully_shard`` every expert-parallel MoE block's experts of ``model`` over ``replicas``
    (``expert_torch_mesh(...)["ep_replica"]``, whose ``ep`` axis the experts are split over),
    gradients summed over it and divided by ``dp``. ``mp_policy``: FSDP's mixed precision (the
    same as the rest of the model's). Returns how many blocks' experts it sharded.

    Each rank's ``E / ep`` experts are cut over the replicas by expert (dim 0) when the replicas
    divide them, else along dim 1 (``2I`` of ``gate_up_proj``, ``C`` of ``down_proj``) when the
    replicas divide those; anything else is one ``ValueError`` before any block changes."""
    blocks = [m for m in model.modules() if getattr(m, EP_RECORD, None) is not None]
    n = replicas.size()
    placements = {}
    for block in blocks:  # every block checked before any changes
        local = {name: tuple(getattr(block.experts, name).to_local().shape) for name in EXPERT_PARAMS}
        dim = replica_cut(local, n)
        if dim is None:
            raise ValueError(replica_cut_error(local, n))
        placements[block] = Shard(dim)
    options = {} if mp_policy is None else {"mp_policy": mp_policy}
    for block in blocks:
        cut = placements[block]
        experts = fully_shard(block.experts, mesh=replicas, shard_placement_fn=lambda _, p=cut: p, **options)
        # summed over the replicas, then divided by dp in the hook that runs on the sum: FSDP's own
        # divide factor would divide twice on a one-rank mesh (torch 2.13), and gloo has no
        # pre-multiplied sum
        experts.set_gradient_divide_factor(1.0)
        experts.set_force_sum_reduction_for_comms(True)
        experts.set_all_reduce_hook(lambda summed: summed.div_(dp))
    return len(blocks)


def replica_cut(local: Mapping[str, tuple[int, ...]], replicas: int) -> int | None:
    """The dim a rank's experts (``local``: their shapes by parameter name) are cut along over
    ``replicas`` ranks: 0 (by expert) where the replicas divide them, else 1, else None."""
    for dim in (0, 1):
        if all(shape[dim] % replicas == 0 for shape in local.values()):
            return dim
    return None


def replica_cut_error(local: Mapping[str, tuple[int, ...]], replicas: int) -> str:
    """The line that refuses experts of shapes ``local`` which no dim of cuts over ``replicas``."""
    sizes = ", ".join(f"{name} {list(shape)}" for name, shape in sorted(local.items()))
    return (
        f"FSDP over {replicas} expert replicas: this rank's experts ({sizes}) divide by {replicas} neither "
        "by expert (dim 0) nor along dim 1"
    )
