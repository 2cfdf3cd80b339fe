"""Expert parallelism beside context and data parallelism, with the router's load-balancing loss
(real gloo ranks; tiny transformers Qwen3.5 MoE, 8 experts, top-2, fp64).

The launched ranks form a mesh (dp, cp); EP takes ``ep`` consecutive ranks of it (the CP group at
ep = cp, the whole world at ep = dp x cp). Each rank's objective is its share of the one-device
loss (cross-entropy over the global batch's tokens plus ``router_aux_loss_coef`` times the
load-balancing loss over all of them); summed over the ranks, the loss, the logits and every
gradient equal one process on the whole batch:

- against the same model on one process with our GDN layers (1e-6);
- against transformers' own ``output_router_logits=True`` loss (its GDN gates are fp32 in an fp64
  model: 1e-4 on A_log and dt_bias, 1e-5 elsewhere, as in the CP tests)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed_harness import run_ranks
from tiny_models import tiny_model
from torch.distributed.tensor import DTensor

from hyperpar_gdn import (
    apply_context_parallel,
    context_parallel_loss,
    init_device_mesh,
    shard_for_context_parallel,
)
from hyperpar_gdn.distributed.layout import TokenLayout
from hyperpar_gdn.distributed.mesh import DeviceMesh
from hyperpar_gdn.expert_parallel import apply_expert_parallel, load_balancing_loss, record_router_logits
from hyperpar_gdn.expert_parallel.grads import expert_mesh, expert_parameters
from hyperpar_gdn.tensor_parallel import apply_tensor_parallel, canonical_grads

B, T, E, K, COEF = 2, 32, 8, 2, 0.3


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def _one_process(base: torch.nn.Module, ids: torch.Tensor, mesh: DeviceMesh) -> tuple:
    """(loss, logits, grads) of the model with our GDN layers on one rank, loss as transformers'."""
    model = copy.deepcopy(base)
    solo = DeviceMesh.from_group(mesh.platform, None, [dist.get_rank()], mesh_dim_name="cp")
    apply_context_parallel(model, solo, mode="p2p")
    with record_router_logits(model) as router_logits:
        logits = model(input_ids=ids, use_cache=False).logits
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss = ce + COEF * load_balancing_loss(router_logits, top_k=K)
    loss.backward()
    return loss.detach(), logits.detach(), {n: p.grad for n, p in model.named_parameters()}


def _worker(rank: int, world: int, dp: int, ep: int, layout: str, tp: int = 1) -> dict[str, float]:
    cp = world // (dp * tp)
    mesh = init_device_mesh("cpu", (dp, cp, tp), mesh_dim_names=("dp", "cp", "tp"))
    ep_mesh = expert_mesh((dp, cp, tp), ep, device_type="cpu")
    base = tiny_model(moe=True, num_experts=E)
    base.config.router_aux_loss_coef = base.router_aux_loss_coef = COEF
    ids = torch.randint(0, 61, (B, T), generator=torch.Generator().manual_seed(4))

    ref = copy.deepcopy(base)
    out = ref(input_ids=ids, labels=ids, output_router_logits=True, use_cache=False)
    out.loss.backward()
    solo_loss, solo_logits, solo_grads = _one_process(base, ids, mesh)

    model = apply_expert_parallel(copy.deepcopy(base), ep_mesh["ep"])
    if tp > 1:  # heads over tp; the MoE blocks stay whole over tp (their experts over ep)
        apply_tensor_parallel(model, mesh["tp"])
    apply_context_parallel(model, mesh["cp"], mode="p2p", layout=layout)
    dp_rank, cp_rank = mesh["dp"].get_local_rank(), mesh["cp"].get_local_rank()
    rows = slice(dp_rank * B // dp, (dp_rank + 1) * B // dp)
    shard = shard_for_context_parallel(mesh["cp"], ids[rows], layout=layout)
    with record_router_logits(model) as router_logits:
        logits = model(**shard.model_inputs(), use_cache=False).logits
    ce = context_parallel_loss(logits, shard.labels, mesh["cp"])  # the replica's token mean
    aux = load_balancing_loss(router_logits, top_k=K, meshes=(mesh["cp"], mesh["dp"]))
    loss = ce / dp + COEF * aux  # this rank's share of the one-device loss
    loss.backward()

    total = loss.detach().clone()
    _sum_over_tokens(total, mesh)
    positions = torch.as_tensor(TokenLayout.of(layout, [T // cp] * cp).positions(cp_rank))
    errors = {
        "loss": _rel(total, solo_loss),
        "logits": _rel(logits.detach(), solo_logits[rows][:, positions]),
        "transformers/loss": _rel(total, out.loss.detach()),
        "transformers/aux": _rel(load_balancing_loss(_routers(ref, ids), top_k=K), out.aux_loss.detach()),
    }
    experts = {id(p) for p in expert_parameters(model)}
    summed = {}
    for name, p in model.named_parameters():  # every rank's share, summed over the token ranks
        local = (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clone()
        if id(p) in experts:  # this rank's experts: summed over the ranks holding them
            dist.all_reduce(local, group=ep_mesh["ep_replica"].get_group())
        else:
            _sum_over_tokens(local, mesh)
        is_shard = isinstance(p.grad, DTensor)
        summed[name] = DTensor.from_local(local, p.grad.device_mesh, p.grad.placements) if is_shard else local
    for name, grad in canonical_grads(model, summed).items():  # whole, in transformers' row order
        errors[name] = _rel(grad, solo_grads[name])
        errors[f"transformers/{name}"] = _rel(grad, dict(ref.named_parameters())[name].grad)
    return errors


def _sum_over_tokens(x: torch.Tensor, mesh: object) -> None:
    """In place: summed over the (dp, cp) ranks of this TP index (the ranks holding different tokens)."""
    for axis in ("cp", "dp"):
        if mesh[axis].size() > 1:
            dist.all_reduce(x, group=mesh[axis].get_group())


def _routers(model: torch.nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad(), record_router_logits(model) as router_logits:
        model(input_ids=ids, use_cache=False)
    return router_logits


@pytest.mark.parametrize(
    "world,dp,ep,layout,tp",
    [
        (2, 1, 2, "contiguous", 1),
        (4, 2, 2, "head_tail", 1),
        (4, 2, 4, "head_tail", 1),
        (4, 1, 2, "head_tail", 2),
    ],
    ids=["dp1-cp2-ep2", "dp2-cp2-ep2", "dp2-cp2-ep4", "cp2-tp2-ep2"],
)
def test_ep_cp_dp_loss_and_gradients_equal_one_process(
    world: int, dp: int, ep: int, layout: str, tp: int
) -> None:
    for rank, errors in enumerate(run_ranks(_worker, world, dp, ep, layout, tp, timeout_s=400)):
        assert len(errors) > 40
        for key, err in errors.items():
            if key.startswith("transformers/"):
                tol = 1e-4 if key.endswith(("A_log", "dt_bias")) else 1e-5
            else:
                tol = 1e-6
            assert err <= tol, f"rank {rank} {key}: relative error {err:.2e} > {tol:.0e}"
