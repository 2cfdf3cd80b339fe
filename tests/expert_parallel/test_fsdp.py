"""FSDP2 over an expert-parallel model (real gloo ranks; tiny transformers Qwen3.5 MoE, top-2,
fp64): the routed experts sharded over their ``ep_replica`` ranks, every other parameter over the
data x CP ranks. After one backward every gradient, gathered whole, and the gradients' norm equal
the same model's without FSDP synced by ``sync_expert_parallel_grads`` (summed over cp, averaged
over dp; the experts' summed over their replicas and divided by dp): on one replica (where FSDP
reduces nothing but still divides), on two cut by expert, and on two cut along dim 1 (one expert
per rank). Each rank holds the parameters the memory plan counts for it."""

from __future__ import annotations

import copy

import pytest
import torch
from distributed_harness import run_ranks
from tiny_models import tiny_model
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from hyperpar_gdn import (
    apply_context_parallel,
    context_parallel_loss,
    init_device_mesh,
    shard_for_context_parallel,
)
from hyperpar_gdn.expert_parallel import apply_expert_parallel
from hyperpar_gdn.expert_parallel.fsdp import expert_torch_mesh
from hyperpar_gdn.expert_parallel.grads import expert_mesh, expert_parameters, sync_expert_parallel_grads
from hyperpar_gdn.parallel.fsdp import apply_fsdp
from hyperpar_gdn.planning.memory import StepOptions, estimate
from hyperpar_gdn.planning.model_shape import ModelShape
from hyperpar_gdn.train.backends.optim import clip_gradients

B, T = 2, 32


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _worker(rank: int, world: int, dp: int, ep: int, num_experts: int) -> dict:
    cp = world // dp
    mesh = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))
    base = tiny_model(moe=True, num_experts=num_experts)
    ids = torch.randint(0, 61, (B, T), generator=torch.Generator().manual_seed(5))
    rows = slice(mesh["dp"].get_local_rank() * B // dp, (mesh["dp"].get_local_rank() + 1) * B // dp)
    grads, norms, cuts = {}, {}, set()
    for fsdp in (False, True):
        model = copy.deepcopy(base)
        build = expert_torch_mesh if fsdp else expert_mesh
        ep_mesh = build((dp, cp, 1), ep, device_type="cpu")
        apply_expert_parallel(model, ep_mesh["ep"])
        apply_context_parallel(model, mesh["cp"], mode="p2p")
        if fsdp:
            apply_fsdp(model, device_type="cpu", dp=dp, expert_replicas=ep_mesh["ep_replica"])
            for p in expert_parameters(model):  # a piece of this rank's experts: 1 / replicas of them
                assert p.to_local().numel() * ep_mesh["ep_replica"].size() * ep == p.numel()
                cuts.add(p.placements[0].dim)
            held = sum(p.to_local().numel() for p in model.parameters())
            opts = StepOptions(seq_len=T, rows=B, cp=cp, tp=1, ep=ep, world_size=world, fsdp=True)
            planned = estimate(ModelShape.of(base.config), opts).terms["optimizer"] // 8  # 2 fp32 moments
        shard = shard_for_context_parallel(mesh["cp"], ids[rows])
        logits = model(**shard.model_inputs(), use_cache=False).logits
        context_parallel_loss(logits, shard.labels, mesh["cp"]).backward()
        if not fsdp:
            sync_expert_parallel_grads(model, mesh, ep_mesh)
        grads[fsdp] = {name: _whole(p.grad) for name, p in model.named_parameters()}
        norms[fsdp] = clip_gradients(model, 0.0)  # over the shards on their two meshes under FSDP
    errors = {
        name: ((grads[True][name] - want).abs().max() / want.abs().max()).item()
        for name, want in grads[False].items()
    }
    errors["gradient norm"] = abs(norms[True] - norms[False]) / norms[False]
    return {"errors": errors, "cuts": sorted(cuts), "held": held, "planned": planned}


@pytest.mark.parametrize(
    "world,dp,ep,num_experts,cut",
    [(2, 1, 2, 8, 0), (4, 2, 4, 8, 0), (4, 2, 2, 8, 0), (4, 2, 2, 2, 1)],
    ids=["dp1-cp2-ep2", "dp2-cp2-ep4-one-replica", "dp2-cp2-ep2-by-expert", "dp2-cp2-ep2-dim1"],
)
def test_fsdp_over_expert_replicas_gives_the_synced_gradients(
    world: int, dp: int, ep: int, num_experts: int, cut: int
) -> None:
    results = run_ranks(_worker, world, dp, ep, num_experts, timeout_s=400)
    # every parameter held once over the ranks: the memory plan's share per rank (E / (dp cp)
    # experts' worth) on average, some ranks a row more of an uneven cut
    held = [result["held"] for result in results]
    assert abs(sum(held) - world * results[0]["planned"]) < world, (held, results[0]["planned"])
    for rank, result in enumerate(results):
        assert result["cuts"] == [cut]
        assert len(result["errors"]) > 30
        for name, err in result["errors"].items():
            assert err <= 1e-12, f"rank {rank} {name}: relative error {err:.2e}"


def _refused(rank: int, world: int) -> str:
    model = tiny_model(moe=True, num_experts=4)  # 2 experts per rank at ep 2; 2I = 48, C = 32
    ep_mesh = expert_torch_mesh((1, world, 1), 2, device_type="cpu")
    apply_expert_parallel(model, ep_mesh["ep"])
    before = [(p.device_mesh, p.placements) for p in expert_parameters(model)]
    with pytest.raises(ValueError) as refused:
        apply_fsdp(model, device_type="cpu", dp=1, expert_replicas=ep_mesh["ep_replica"])
    assert [(p.device_mesh, p.placements) for p in expert_parameters(model)] == before
    assert not any(isinstance(m, FSDPModule) for m in model.modules())
    return str(refused.value)


def test_replicas_that_cut_no_dim_evenly_are_refused_before_any_change() -> None:
    """3 replicas of 2 experts [2, 48, 32] and [2, 32, 24] (3 divides 2I but not C): one
    ``ValueError`` on every rank, naming the sizes, the model as it was."""
    for message in run_ranks(_refused, 6, timeout_s=400):
        assert message == (
            "FSDP over 3 expert replicas: this rank's experts (down_proj [2, 32, 24], gate_up_proj "
            "[2, 48, 32]) divide by 3 neither by expert (dim 0) nor along dim 1"
        )
