"""The router's load-balancing loss of a MoE model whose batch is split over ranks (torch).

transformers' ``load_balancing_loss_func`` (what ``output_router_logits=True`` adds to a Qwen3.5
MoE model's loss, times ``router_aux_loss_coef``) on one device: over the L MoE layers' router
logits ``[N, E]`` of the whole batch,

    f_e = (sum over layers and tokens of [e among the token's top k]) / (L N)
    P_e = (sum over layers and tokens of softmax(logits)_e) / (L N)
    aux = E sum_e f_e P_e

(padding excluded through the attention mask: N then counts the unmasked tokens). Under context
and data parallelism a rank holds some tokens only. :func:`load_balancing_loss` sums the counts
``f`` and N over the ranks that hold the batch's tokens (no gradient flows through a count) and
returns this rank's share ``E sum_e f_e P_e^rank``, ``P^rank`` its own tokens' probabilities over
the global ``L N``: the shares of all ranks add up to the one-device loss, and so do their
gradients (which reach the routers through this rank's logits only).

:func:`record_router_logits` collects the router logits of a forward with hooks on every MoE
block's router (no model argument needed, and the recomputed forwards of activation
checkpointing, which run outside the block, are not collected twice).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from hyperpar_gdn.distributed.mesh import as_cp_mesh
from hyperpar_gdn.expert_parallel.style import is_moe_block

__all__ = ["load_balancing_loss", "record_router_logits"]


@contextlib.contextmanager
def record_router_logits(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """Inside the block, every MoE router's logits ``[N, E]`` of this rank's forwards, in call
    order (the routers are the ``gate`` of each Qwen3.5 sparse MoE block of ``model``)."""
    found: list[torch.Tensor] = []
    open_ = [True]

    def hook(module: Any, args: Any, output: Any) -> None:
        if open_[0]:
            found.append(output[0] if isinstance(output, tuple) else output)

    routers = [m.gate for m in model.modules() if is_moe_block(m)]
    if not routers:
        raise ValueError(f"{type(model).__name__} has no MoE block: there are no router logits to record")
    handles = [router.register_forward_hook(hook) for router in routers]
    try:
        yield found
    finally:
        open_[0] = False
        for handle in handles:
            handle.remove()


def load_balancing_loss(
    router_logits: Sequence[torch.Tensor],
    *,
    top_k: int,
    meshes: Sequence[Any] = (),
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """This rank's share of transformers' load-balancing loss over the whole batch (0-d, fp32).

    Args:
        router_logits: per MoE layer, this rank's router logits ``[N, E]``.
        top_k: experts per token.
        meshes: the 1-D meshes over which the batch's tokens are spread (e.g. ``mesh["cp"]`` and
            ``mesh["dp"]``); the counts are summed over each in turn (one small all-reduce each).
            Empty: one device.
        mask: ``[N]`` (or any shape of N elements) 1 for a real token, 0 for padding; None: all.

    Summed over the ranks of ``meshes`` the shares equal ``load_balancing_loss_func`` of the
    whole batch on one device, and so do their gradients."""
    if not router_logits:
        raise ValueError("load_balancing_loss needs the router logits of at least one layer")
    first = router_logits[0]
    num_experts, device = first.shape[-1], first.device
    counts_E = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs_E = torch.zeros(num_experts, dtype=torch.float32, device=device)
    flat = None if mask is None else mask.reshape(-1).to(device=device, dtype=torch.float32)
    rows = torch.zeros(1, dtype=torch.float32, device=device)
    for logits in router_logits:
        probs = torch.softmax(logits, dim=-1)
        chosen = torch.topk(probs, top_k, dim=-1).indices.reshape(-1)
        weight = (
            torch.ones_like(chosen, dtype=torch.float32) if flat is None else flat.repeat_interleave(top_k)
        )
        counts_E = counts_E.index_add(0, chosen, weight.detach())
        if flat is None:
            probs_E = probs_E + probs.float().sum(0)
            rows = rows + probs.shape[0]
        else:
            probs_E = probs_E + (probs.float() * flat[:, None]).sum(0)
            rows = rows + flat.sum()
    totals = torch.cat([counts_E, rows]).detach()
    for mesh in meshes:
        axis = as_cp_mesh(mesh)
        if axis.size() > 1:
            totals = axis.platform.collectives.all_reduce_sum(totals, axis.get_group())
    counts_E, rows = totals[:-1], totals[-1]
    return num_experts * torch.sum((counts_E / rows) * (probs_E / rows))
