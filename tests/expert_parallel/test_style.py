"""Expert parallelism of transformers' Qwen3.5 MoE (real gloo ranks): a tiny model with 8 experts,
top-2, its experts split over ep = 2 and 4 ranks, each rank bringing its own rows of the batch.

- logits and every parameter gradient equal one process on the whole batch (fp64, 1e-6; fp32
  through torch's grouped matmul, 1e-5);
- the rows each rank's experts compute equal the count of (token, expert) pairs routed to its
  experts by one process's router, and the bytes each rank sends equal docs/expert_parallel.md's
  formula;
- the grouped matmul equals the reference loop; wrong set-ups raise before any change."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from distributed_harness import run_ranks
from tiny_models import tiny_model
from torch.distributed.tensor import DTensor

from hyperpar_gdn import init_device_mesh
from hyperpar_gdn.expert_parallel import (
    apply_expert_parallel,
    count_ep_traffic,
    expert_parallel_error,
    grouped_swiglu,
    grouped_swiglu_loop,
)
from hyperpar_gdn.expert_parallel.grouped import grouped_mm_runs

B, T, E, K = 4, 24, 8, 2
TOL = {torch.float64: 1e-6, torch.float32: 1e-5}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def _routes(model: torch.nn.Module) -> list[torch.Tensor]:
    """Hooks that record every router's top-k expert indices ``[N, k]``, layer by layer."""
    found: list[torch.Tensor] = []
    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(lambda m, a, out: found.append(out[2].detach()))
    return found


def _whole_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every gradient as one process holds it: the experts' gathered, the rest summed over ranks."""
    out = {}
    for name, p in model.named_parameters():
        if isinstance(p.grad, DTensor):
            out[name] = p.grad.full_tensor()
        else:
            g = p.grad.detach().clone()
            dist.all_reduce(g)
            out[name] = g
    return out


def _ep_worker(rank: int, world: int, dtype: torch.dtype) -> dict[str, float]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    base = tiny_model(moe=True, num_experts=E).to(dtype)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 61, (B, T), generator=gen)
    weight = torch.randn(B, T, 61, generator=gen, dtype=dtype)
    ref = copy.deepcopy(base)
    routes = _routes(ref)
    ref_logits = ref(input_ids=ids, use_cache=False).logits
    (ref_logits * weight).sum().backward()

    model = apply_expert_parallel(copy.deepcopy(base), mesh["ep"])
    rows = slice(rank * B // world, (rank + 1) * B // world)
    collectives = mesh.platform.collectives
    before = collectives.bytes_sent
    with count_ep_traffic() as traffic:
        logits = model(input_ids=ids[rows], use_cache=False).logits
        (logits * weight[rows]).sum().backward()
    sent_bytes = collectives.bytes_sent - before

    errors = {"logits": _rel(logits.detach(), ref_logits[rows].detach())}
    grads = _whole_grads(model)
    for name, p in ref.named_parameters():
        errors[name] = _rel(grads[name], p.grad)
    # the formula: rows = pairs routed to this rank's experts; bytes per MoE layer
    # 2 (sent + received) C s + (ep - 1) (E / ep) 8
    local = E // world
    mine = torch.zeros(B, T, dtype=torch.bool)
    mine[rows] = True
    mine = mine.reshape(-1, 1).expand(-1, K)
    expected_bytes = 0
    for layer, (idx, got) in enumerate(zip(routes, traffic.dispatches, strict=True)):
        here = (idx // local) == rank
        rows_expected = int(here.sum())
        sent, received = int((mine & ~here).sum()), int((~mine & here).sum())
        errors[f"rows layer {layer}"] = abs(got.rows - rows_expected)
        errors[f"sent layer {layer}"] = abs(got.sent - sent) + abs(got.received - received)
        expected_bytes += 2 * (sent + received) * base.config.hidden_size * weight.element_size()
        expected_bytes += (world - 1) * local * 8
    errors["bytes"] = abs(sent_bytes - expected_bytes)
    errors["_rows"] = [d.rows for d in traffic.dispatches]
    errors["_grouped"] = grouped_mm_runs(
        torch.zeros(1, 32, dtype=dtype), model.model.layers[0].mlp.experts.gate_up_proj.to_local()
    )
    return errors


def _refusals_worker(rank: int, world: int) -> str:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    model = tiny_model(moe=True, num_experts=E)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    wrapped = model.model.layers[2].mlp
    wrapped.experts = torch.nn.Sequential(wrapped.experts)  # a wrapper around the fused experts
    with pytest.raises(ValueError, match="layer 2: experts .*wrapper") as info:
        apply_expert_parallel(model, mesh["ep"])
    unchanged = all(
        torch.equal(p, before[n.replace("experts.0.", "experts.")]) for n, p in model.named_parameters()
    )
    assert unchanged and not any(isinstance(p, DTensor) for p in model.parameters())
    return str(info.value)


@pytest.mark.parametrize("ep", [2, 4], ids=["ep2", "ep4"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_expert_parallel_equals_one_process(ep: int, dtype: torch.dtype) -> None:
    for rank, errors in enumerate(run_ranks(_ep_worker, ep, dtype, timeout_s=300)):
        rows, grouped = errors.pop("_rows"), errors.pop("_grouped")
        assert grouped == (dtype == torch.float32), f"rank {rank}: grouped matmul used={grouped}"
        assert len(rows) == 4 and sum(rows) > 0
        assert errors.pop("bytes") == 0, f"rank {rank}: bytes sent differ from the formula"
        for key, err in errors.items():
            limit = 0 if key.startswith(("rows", "sent")) else TOL[dtype]
            assert err <= limit, f"ep {ep} rank {rank} {key}: {err:.2e} > {limit:.0e}"


def test_wrong_setups_refused_before_any_change() -> None:
    messages = run_ranks(_refusals_worker, 2, timeout_s=120)
    assert messages[0] == messages[1]
    block = tiny_model(moe=True, num_experts=E).model.layers[0].mlp
    assert expert_parallel_error(block, 3) == "num_experts=8 is not divisible by ep=3"
    assert expert_parallel_error(block, 4) is None


@pytest.mark.parametrize("counts", [(3, 0, 5, 2), (0, 0, 0, 1), (4, 4, 4, 4)], ids=str)
def test_grouped_matmul_equals_loop(counts: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(sum(counts), 32, generator=gen, requires_grad=True)
    gate_up = torch.randn(len(counts), 48, 32, generator=gen, requires_grad=True)
    down = torch.randn(len(counts), 32, 24, generator=gen, requires_grad=True)
    assert grouped_mm_runs(x, gate_up)
    g = torch.randn(sum(counts), 32, generator=gen)
    fast = grouped_swiglu(x, counts, gate_up, down)
    fast_grads = torch.autograd.grad((fast * g).sum(), (x, gate_up, down))
    ref = grouped_swiglu_loop(x, counts, gate_up, down)
    ref_grads = torch.autograd.grad((ref * g).sum(), (x, gate_up, down))
    assert _rel(fast.detach(), ref.detach()) <= 1e-6
    for a, b in zip(fast_grads, ref_grads, strict=True):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max().clamp_min(1.0)
