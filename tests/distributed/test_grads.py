"""sync_context_parallel_grads on real gloo groups: the gradient shares summed over the CP group
and averaged over the DP axis (values the test recomputes from the ranks), the whole-model loop of
the README equal to one process's gradients, and its refusals before any communication. The
MindSpore side runs in the shared msrun job (tests/distributed/msrun_cp_worker.py, section grads)."""

from __future__ import annotations

import copy

import pytest
import torch
from distributed_harness import run_ranks

from hyperpar_gdn import (
    apply_context_parallel,
    context_parallel_loss,
    init_device_mesh,
    shard_for_context_parallel,
    sync_context_parallel_grads,
)
from hyperpar_gdn.models.lm import HybridLM, HybridLMConfig


def _shares(rank: int, world: int) -> dict[str, list]:
    """On a (dp=2, cp=2) mesh each rank's gradients are (rank + 1) times a fixed pattern; a
    float64 parameter and one without a gradient ride along."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    model = torch.nn.Module()
    model.a = torch.nn.Parameter(torch.zeros(3, 2))
    model.b = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    model.c = torch.nn.Parameter(torch.zeros(2))
    model.a.grad = (rank + 1) * torch.arange(6.0).reshape(3, 2)
    model.b.grad = (rank + 1) * torch.full((4,), 0.5, dtype=torch.float64)
    sync_context_parallel_grads(model, mesh, dp_axis="dp")
    cp_only = [torch.full((2,), float(rank + 1))]
    cp_only = sync_context_parallel_grads(cp_only, mesh["cp"])
    return {
        "cp_group": mesh.get_rank_list("cp"),
        "a": model.a.grad.tolist(),
        "b": model.b.grad.tolist(),
        "b_dtype": str(model.b.grad.dtype),
        "c": model.c.grad.tolist(),
        "cp_only": cp_only[0].tolist(),
    }


def test_sums_over_cp_and_averages_over_dp() -> None:
    results = run_ranks(_shares, 4, timeout_s=60)
    mean_over_all = sum(r + 1 for r in range(4)) / 2  # the sum over a CP group, averaged over DP
    for rank, got in enumerate(results):
        assert rank in got["cp_group"] and len(got["cp_group"]) == 2
        assert got["a"] == (mean_over_all * torch.arange(6.0).reshape(3, 2)).tolist()
        assert got["b"] == [mean_over_all * 0.5] * 4 and got["b_dtype"] == "torch.float64"
        assert got["c"] == [0.0, 0.0]
        assert got["cp_only"] == [float(sum(r + 1 for r in got["cp_group"]))] * 2


def _readme_loop(rank: int, world: int) -> dict[str, float]:
    """The README's whole-model step on HybridLM against one process (float64)."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    base = HybridLM(
        HybridLMConfig(vocab_size=61, hidden_size=32, num_layers=4, linear_num_key_heads=2)
    ).double()
    ids = torch.randint(0, 61, (2, 32), generator=torch.Generator().manual_seed(1))
    reference = copy.deepcopy(base)
    logits = reference(ids)
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 61), ids[:, 1:].reshape(-1)).backward()
    model = apply_context_parallel(base, mesh, mode="p2p")
    shard = shard_for_context_parallel(mesh, ids)
    context_parallel_loss(model(shard.input_ids), shard.labels, mesh).backward()
    sync_context_parallel_grads(model, mesh)
    errors = {}
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        errors[name] = ((p.grad - q.grad).abs().max() / q.grad.abs().max()).item()
    return errors


def test_readme_loop_equals_one_process() -> None:
    for errors in run_ranks(_readme_loop, 2, timeout_s=120):
        assert len(errors) > 10
        assert max(errors.values()) <= 1e-6, max(errors.items(), key=lambda kv: kv[1])


def _refusals(rank: int, world: int) -> list[str]:
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    model = torch.nn.Linear(4, 4)
    model(torch.ones(2, 4)).sum().backward()
    messages = []
    for call in (
        lambda: sync_context_parallel_grads(model, mesh, dp_axis="dp"),
        lambda: sync_context_parallel_grads(
            model, init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "cp")), cp_axis="seq"
        ),
        lambda: sync_context_parallel_grads(object(), mesh),
    ):
        try:
            call()
            messages.append("no error")
        except (ValueError, TypeError) as err:
            messages.append(str(err))
    sharded = torch.nn.Linear(4, 4)
    fully_shard(sharded)
    sharded(torch.ones(2, 4)).sum().backward()
    try:
        sync_context_parallel_grads(sharded, mesh)
        messages.append("no error")
    except ValueError as err:
        messages.append(str(err))
    return messages


def test_refusals() -> None:
    for messages in run_ranks(_refusals, 2, timeout_s=60):
        assert "dp_axis='dp' needs a mesh with named axes; got a 1-D mesh" in messages[0]
        assert "cp_axis='seq' is not an axis of the mesh; its axes are ('dp', 'cp')" in messages[1]
        assert "takes a torch module or a sequence of gradients; got object" in messages[2]
        assert "gradients of type DTensor" in messages[3] and "FSDP sums them" in messages[3]


@pytest.mark.parametrize("dp_axis", [None, "dp"])
def test_one_rank_is_the_identity(dp_axis: str | None) -> None:
    def worker(rank: int, world: int) -> list[float]:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "cp"))
        return sync_context_parallel_grads([torch.tensor([1.5, -2.0])], mesh, dp_axis=dp_axis)[0].tolist()

    assert run_ranks(worker, 1, timeout_s=30) == [[1.5, -2.0]]


def test_mindspore_gradients() -> None:
    pytest.importorskip("mindspore")
    from msrun_harness import cp_worker_job, section_data

    mean_over_all = sum(r + 1 for r in range(4)) / 2
    for got in section_data(cp_worker_job(4), "grads"):
        assert got["both"][0] == (mean_over_all * torch.arange(6.0).reshape(3, 2)).tolist()
        assert got["both"][1] == [mean_over_all * 0.5] * 4
        assert got["dtypes"] == ["Float32", "Float64"]
        group_sum = float(sum(r + 1 for r in got["cp_group"]))
        assert got["cp_only"][0] == (group_sum * torch.arange(6.0).reshape(3, 2)).tolist()
        assert got["cp_only"][1] == [group_sum * 0.5] * 4
        assert got["inputs_unchanged"]
