"""The optimizer settings and the learning-rate schedule, and torch's AdamW set up with them.

Both backends use the same settings: AdamW with betas (0.9, 0.95), eps 1e-8, weight decay on
matrices (parameters of 2 or more dims) only, the global gradient norm clipped to ``--grad-clip``
(0: off), and a learning rate that rises linearly over ``--warmup-steps`` to ``--lr``, then stays.
MindSpore's AdamW with these settings is :class:`hyperpar_gdn.train.mindspore_adamw.AdamW`.
"""

from __future__ import annotations

import torch

from hyperpar_gdn.train.config import TrainConfig

__all__ = [
    "BETAS",
    "EPS",
    "adamw_step",
    "build_adamw",
    "clip_gradients",
    "global_grad_norm",
    "learning_rate",
    "torch_optimizer_step",
]

BETAS = (0.9, 0.95)
EPS = 1e-8


def learning_rate(config: TrainConfig, step: int) -> float:
    """The learning rate of optimizer step ``step`` (1-based): linear warm-up, then constant."""
    scale = min(1.0, step / config.warmup_steps) if config.warmup_steps else 1.0
    return config.lr * scale


def build_adamw(model: torch.nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    """torch's AdamW over ``model``'s parameters, weight decay on matrices (>= 2-D) only."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=BETAS, eps=EPS)


def clip_gradients(model: torch.nn.Module, grad_clip: float) -> float:
    """The global 2-norm of ``model``'s gradients before clipping; clips them to ``grad_clip`` when
    it is > 0 (0: the norm only; the gradients are multiplied by exactly 1). Under FSDP the norm is
    that of the whole gradient (torch reduces the shards' norms); under tensor parallelism, whose
    gradients are shards on the TP mesh beside whole tensors (or FSDP shards on another mesh), it
    is :func:`global_grad_norm`'s."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    meshes = {getattr(g, "device_mesh", None) for g in grads}
    if len(meshes) <= 1:  # all whole, or all shards on one mesh: torch's own
        limit = grad_clip if grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), limit)
        if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
            norm = norm.full_tensor()
        return float(norm.item())
    total = float(global_grad_norm(grads).item())
    if grad_clip > 0:  # torch's rule: scale by max / (norm + 1e-6) when that is below 1
        coef = min(1.0, grad_clip / (total + 1e-6))
        with torch.no_grad():
            for g in grads:
                (g.to_local() if hasattr(g, "to_local") else g).mul_(coef)
    return total


def global_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """Collective over every rank: the 2-norm of the whole gradient whose pieces are ``grads``
    (this rank's), DTensor shards on any meshes or tensors every rank holds whole. Each rank adds
    its pieces' squares weighted by (the tensor's distinct shards / the world size): the ranks
    holding the same shard (its copies on the other axes) then count it once in the sum."""
    import torch.distributed as dist

    world, device = dist.get_world_size(), grads[0].device
    # float64 for the sum, but float32 on NPUs (HCCL reduces fewer dtypes)
    total = torch.zeros((), dtype=torch.float32 if device.type == "npu" else torch.float64, device=device)
    for g in grads:
        shards = 1
        if hasattr(g, "to_local"):
            for axis, placement in enumerate(g.placements):
                if not placement.is_replicate():  # Shard, or FSDP's _StridedShard over TP's
                    shards *= g.device_mesh.size(axis)
            g = g.to_local()
        total += g.detach().to(total.dtype).square().sum() * (shards / world)
    dist.all_reduce(total)
    return total.sqrt()


def adamw_step(optimizer: torch.optim.Optimizer, *, lr: float) -> None:
    """Step at ``lr``, then clear the gradients."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def torch_optimizer_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, grad_clip: float, lr: float
) -> None:
    """Clip the global gradient norm (``grad_clip`` > 0), step at ``lr``, clear the gradients."""
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    adamw_step(optimizer, lr=lr)
