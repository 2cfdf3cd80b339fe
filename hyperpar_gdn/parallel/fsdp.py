"""Parameter sharding (FSDP2) of a whole model, the last part to go on.

``fully_shard`` per decoder layer and on the whole model, after tensor parallelism, context
parallelism and activation checkpointing. FSDP shards over every rank of the ``dp x cp`` world as
one axis (under tensor parallelism, over the flattened ``(dp, cp)`` axes of each TP rank's slice of
the ``(dp, cp, tp)`` mesh): each CP rank holds whole-model gradient shares, just as a DP replica
does. Its reduce-scatter sums the gradients over those ranks and divides by ``dp``: summed over
each CP group, averaged over the DP replicas, exactly what the trainer's all-reduces do without
FSDP. Under expert parallelism the routed experts go first, over the ranks holding the same
experts (:mod:`hyperpar_gdn.expert_parallel.fsdp`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from hyperpar_gdn.distributed.decoder_layers import text_model_of
from hyperpar_gdn.expert_parallel.fsdp import fully_shard_experts

__all__ = ["apply_fsdp", "fsdp_mesh_of"]


def apply_fsdp(
    model: torch.nn.Module,
    *,
    device_type: str,
    dp: int,
    bf16: bool = False,
    mesh: Any = None,
    expert_replicas: Any = None,
) -> None:
    """Shard parameters, gradients and optimizer state over every rank (FSDP2). ``bf16``: the
    gathered parameters are bf16 for compute, the sharded ones (what AdamW updates and
    checkpoints hold) stay fp32 and gradients are reduced in fp32. ``mesh``: the 1-D torch mesh to
    shard over (under tensor parallelism the flattened ``(dp, cp)`` axes of the ``(dp, cp, tp)``
    mesh whose ``tp`` axis holds the TP shards); default: every rank. ``expert_replicas``: under
    expert parallelism, the ``ep_replica`` axis the routed experts are sharded over instead
    (:func:`~hyperpar_gdn.expert_parallel.fsdp.fully_shard_experts`)."""
    if mesh is None:
        mesh = fsdp_mesh_of(device_type)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    options = {"mesh": mesh} if policy is None else {"mesh": mesh, "mp_policy": policy}
    if expert_replicas is not None:
        fully_shard_experts(model, expert_replicas, dp=dp, mp_policy=policy)
    for module in (*text_model_of(model).layers, model):
        fully_shard(module, **options)
        module.set_gradient_divide_factor(float(dp))
        module.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum


def fsdp_mesh_of(device_type: str, tp_mesh: Any = None) -> Any:
    """The 1-D torch mesh FSDP shards over (collective): every rank, or under tensor parallelism
    the flattened ``(dp, cp)`` axes of torch's ``(dp, cp, tp)`` mesh ``tp_mesh``."""
    if tp_mesh is None:
        return init_device_mesh(device_type, (torch.distributed.get_world_size(),))
    return tp_mesh["dp", "cp"]._flatten("dp_cp")
