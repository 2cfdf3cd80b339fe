"""The optimizer settings and the learning-rate schedule, and torch's AdamW set up with them.

Both backends use the same settings: AdamW with betas (0.9, 0.95), eps 1e-8, weight decay on
matrices (parameters of 2 or more dims) only, the global gradient norm clipped to ``--grad-clip``
(0: off), and a learning rate that rises linearly over ``--warmup-steps`` to ``--lr``, then stays.
MindSpore's AdamW with these settings is :class:`hyperpar_gdn.train.backends.mindspore_adamw.AdamW`.
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
    is :func:`~hyperpar_gdn.tensor_parallel.comm.clip_grad_norm_`'s."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    meshes = {getattr(g, "device_mesh", None) for g in grads}
    if len(meshes) <= 1:  # all whole, or all shards on one mesh: torch's own
        limit = grad_clip if grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), limit)
        if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
            norm = norm.full_tensor()
        return float(norm.item())
    from hyperpar_gdn.tensor_parallel.comm import clip_grad_norm_

    return float(clip_grad_norm_(grads, grad_clip).item())


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
