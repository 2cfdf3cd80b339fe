"""Tensor parallelism in the context-parallel Trainer (``tp_size`` > 1): what replaces DDP.

accelerate's DDP cannot hold a model whose parameters are ``DTensor`` shards, and it would
average every rank's gradient, TP ranks' different shards included. Under ``tp_size`` the model
is prepared without DDP (:func:`prepare_without_ddp`: accelerate's device placement and autocast
only) and, once per optimizer step, before clipping, :func:`sync_grads` averages each rank's
gradients over the ranks holding the same shard (the library's
:func:`~hyperpar_gdn.tensor_parallel.comm.sync_tp_grads`, then divided by cp: the loss carries
the factor dp x cp, as under DDP it carries the world). Under ``ep_size`` (with or without
tp) the routed experts' gradients are summed over the ranks holding the same experts instead. The
norm and clipping are the whole model's (:func:`~hyperpar_gdn.tensor_parallel.comm.clip_grad_norm_`:
each shard counted once, a TP shard over its tp ranks, an expert over its ep ranks).

Legend: dp, cp, tp: the mesh's axes (tp innermost).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["prepare_without_ddp", "sync_grads"]


def prepare_without_ddp(accelerator: Any) -> None:
    """Make ``accelerator.prepare_model`` place the model and add autocast, never wrap it in DDP
    (its evaluation path); the gradients are averaged by :func:`sync_grads` instead."""
    original = type(accelerator).prepare_model.__get__(accelerator)

    def prepare_model(model: Any, device_placement: bool | None = None, evaluation_mode: bool = False) -> Any:
        return original(model, device_placement=device_placement, evaluation_mode=True)

    accelerator.prepare_model = prepare_model


def sync_grads(model: torch.nn.Module, mesh: Any, *, ep_mesh: Any = None) -> None:
    """Average the gradients of ``model`` over the ranks that hold the same TP shard (the (dp, cp)
    ranks of this TP rank), in place: summed over ``mesh["cp"]``, averaged over ``mesh["dp"]``,
    divided by cp. With ``ep_mesh`` (expert parallelism) the routed experts' are summed over the
    ranks holding the same experts instead (:func:`~hyperpar_gdn.expert_parallel.grads.sync_expert_parallel_grads`)."""
    if ep_mesh is not None:
        from hyperpar_gdn.expert_parallel.grads import sync_expert_parallel_grads

        sync_expert_parallel_grads(model, mesh, ep_mesh)
    else:
        from hyperpar_gdn.tensor_parallel.comm import sync_tp_grads

        sync_tp_grads(model, mesh)
    cp = mesh.size("cp")
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).div_(cp)
