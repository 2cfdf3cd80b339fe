"""Parameter sharding (FSDP2), activation checkpointing and full state dicts for the torch trainer.

Order, as torchtitan's: tensor parallelism (``--tp``) first, then context parallelism (it
replaces the mixers' forwards), then activation checkpointing per decoder layer
(``checkpoint_wrapper``: the layer's forward, collectives included, runs again in the backward),
then ``fully_shard`` per decoder layer and on the whole model. FSDP shards over every rank of the
``dp x cp`` world as one axis (under ``--tp``, over the flattened ``(dp, cp)`` axes of each TP
rank's slice of the ``(dp, cp, tp)`` mesh): each CP rank holds whole-model gradient shares, just
as a DP replica does. Its reduce-scatter sums the gradients over those ranks and divides by
``dp``: summed over each CP group, averaged over the DP replicas, exactly what the trainer's
all-reduces do without FSDP.

Checkpoints hold full (gathered) state dicts with parameter names as keys, with or without FSDP
and activation checkpointing, so a run saved with ``--fsdp`` resumes without it and back.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from hyperpar_gdn.distributed.decoder_layers import text_model_of
from hyperpar_gdn.expert_parallel.fsdp import fully_shard_experts

__all__ = [
    "apply_activation_checkpointing",
    "apply_fsdp",
    "full_model_state_dict",
    "full_state_dicts",
    "load_full_state_dicts",
]

_SAVE = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered on rank 0, on the CPU
_LOAD = StateDictOptions(full_state_dict=True)  # every rank holds the full dicts it read


def apply_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute every decoder layer in the backward instead of keeping its activations."""
    layers = text_model_of(model).layers
    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer)


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
        mesh = init_device_mesh(device_type, (torch.distributed.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    options = {"mesh": mesh} if policy is None else {"mesh": mesh, "mp_policy": policy}
    if expert_replicas is not None:
        fully_shard_experts(model, expert_replicas, dp=dp, mp_policy=policy)
    for module in (*text_model_of(model).layers, model):
        fully_shard(module, **options)
        module.set_gradient_divide_factor(float(dp))
        module.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum


def full_model_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """The model's state dict keyed by parameter names, whole, on rank 0 (collective under FSDP:
    every rank must call it; the other ranks get an empty dict)."""
    return get_model_state_dict(model, options=_SAVE)


def full_state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(model, optimizer) state dicts keyed by parameter names, whole, on rank 0 (collective
    under FSDP: every rank must call it; the other ranks get empty dicts)."""
    return full_model_state_dict(model), get_optimizer_state_dict(model, optimizer, options=_SAVE)


def load_full_state_dicts(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    model_state: dict[str, Any],
    optimizer_state: dict,
) -> None:
    """Load full state dicts (as :func:`full_state_dicts` writes them) on every rank."""
    set_model_state_dict(model, model_state, options=_LOAD)
    set_optimizer_state_dict(model, optimizer, optimizer_state, options=_LOAD)
