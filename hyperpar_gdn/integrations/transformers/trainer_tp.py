"""Tensor parallelism in the context-parallel Trainer (``tp_size`` > 1): what replaces DDP.

accelerate's DDP cannot hold a model whose parameters are ``DTensor`` shards, and it would
average every rank's gradient, TP ranks' different shards included. Under ``tp_size`` the model
is prepared without DDP (:func:`prepare_without_ddp`: accelerate's device placement and autocast
only) and, once per optimizer step, before clipping, :func:`sync_grads` averages each rank's
gradients (its TP shard's local part, or a whole parameter's gradient, the same on every TP rank)
over the ranks holding the same shard: summed over the CP axis, averaged over DP, divided by cp
(the loss carries the factor dp x cp, as under DDP it carries the world). :func:`clip_grad_norm`
is the whole model's norm: the shards' squares summed over the TP group, the whole parameters'
counted once.

Legend: dp, cp, tp: the mesh's axes (tp innermost).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hyperpar_gdn.distributed.grads import sync_context_parallel_grads

__all__ = ["clip_grad_norm", "prepare_without_ddp", "sync_grads"]


def prepare_without_ddp(accelerator: Any) -> None:
    """Make ``accelerator.prepare_model`` place the model and add autocast, never wrap it in DDP
    (its evaluation path); the gradients are averaged by :func:`sync_grads` instead."""
    original = type(accelerator).prepare_model.__get__(accelerator)

    def prepare_model(model: Any, device_placement: bool | None = None, evaluation_mode: bool = False) -> Any:
        return original(model, device_placement=device_placement, evaluation_mode=True)

    accelerator.prepare_model = prepare_model


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad


def sync_grads(model: torch.nn.Module, mesh: Any) -> None:
    """Average the gradients of ``model`` over the ranks that hold the same TP shard (the (dp, cp)
    ranks of this TP rank), in place: summed over ``mesh["cp"]``, averaged over ``mesh["dp"]``,
    divided by cp. A parameter without a gradient counts as zeros."""
    params = [p for p in model.parameters() if p.requires_grad]
    cp = mesh.size("cp")
    with torch.no_grad():
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        local = [_local(p.grad) for p in params]
        summed = sync_context_parallel_grads(local, mesh, cp_axis="cp", dp_axis="dp")
        for mine, total in zip(local, summed, strict=True):
            mine.copy_(total / cp)


def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float, tp_group: Any) -> torch.Tensor:
    """The 2-norm of the whole model's gradient (the TP shards' squares summed over ``tp_group``)
    and, as ``torch.nn.utils.clip_grad_norm_``, every gradient scaled by
    ``min(1, max_norm / (norm + 1e-6))``; returns the norm before clipping (fp32)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    device = _local(grads[0]).device
    sharded = torch.zeros((), dtype=torch.float64, device=device)
    whole = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        square = _local(g).detach().double().pow(2).sum()
        if isinstance(g, DTensor):
            sharded += square
        else:
            whole += square
    dist.all_reduce(sharded, op=dist.ReduceOp.SUM, group=tp_group)
    norm = (sharded + whole).sqrt().float()
    if max_norm != float("inf"):
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        with torch.no_grad():
            for g in grads:
                _local(g).mul_(coef.to(g.dtype))
    return norm
