"""parallelize() on real gloo ranks (4: a (cp, tp) = (2, 2) mesh; fp64 HybridLM).

- tensor parallelism, context parallelism (p2p, head_tail), activation checkpointing and FSDP2 in
  one call: each part on the model in its order, and the logits and every parameter gradient
  equal one process on the whole batch;
- refusals, on every rank before any change (parameters, forward and modules as they were): a
  CP mode that the TP rank's heads cannot run (though the whole layer's could), one rank alone
  refusing, ranks given different set-ups;
- an exception while applying (in FSDP, the last part) undoes context parallelism and activation
  checkpointing."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from distributed_harness import run_ranks
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX

from hyperpar_gdn import ParallelConfig, init_device_mesh, parallelize, shard_for_context_parallel
from hyperpar_gdn.distributed.decoder_layers import mixers_of, text_model_of
from hyperpar_gdn.distributed.layout import TokenLayout
from hyperpar_gdn.distributed.parallel_style import is_parallelized
from hyperpar_gdn.models.lm import HybridLM, HybridLMConfig
from hyperpar_gdn.ops.head_shard import head_shard_of
from hyperpar_gdn.parallel.checkpointing import is_checkpointed
from hyperpar_gdn.tensor_parallel import canonical_grads

T = 32


def _model(value_heads: int = 4) -> HybridLM:
    torch.manual_seed(0)
    config = HybridLMConfig(
        vocab_size=61,
        hidden_size=32,
        num_layers=4,
        linear_num_key_heads=2,
        linear_num_value_heads=value_heads,
    )
    return HybridLM(config).double()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def _composed_worker(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.fsdp import FSDPModule

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    base = _model()
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 61, (2, T), generator=gen)
    weight = torch.randn(2, T, 61, generator=gen, dtype=torch.float64)
    ref = copy.deepcopy(base)
    ref_logits = ref(ids)
    (ref_logits * weight).sum().backward()

    model = copy.deepcopy(base)
    config = ParallelConfig(
        tp=2, cp_mode="p2p", cp_layout="head_tail", activation_checkpointing=True, fsdp=True
    )
    done = parallelize(model, mesh, config)
    layers = text_model_of(model).layers
    mixers = [mixer for _, mixer in mixers_of(text_model_of(model))]
    order = {
        "fsdp": isinstance(model, FSDPModule),
        "ac": all(is_checkpointed(layer) for layer in layers),
        "cp": all(is_parallelized(mixer) for mixer in mixers),
        "tp": all(getattr(head_shard_of(mixer), "size", 1) == 2 for mixer in mixers),
    }
    cp = mesh["cp"]
    shard = shard_for_context_parallel(cp, ids, layout="head_tail")
    positions = torch.as_tensor(TokenLayout.of("head_tail", [T // 2] * 2).positions(cp.get_local_rank()))
    logits = model(shard.input_ids, cp_layout=shard.layout)
    (logits * weight[:, positions]).sum().backward()
    # FSDP sums over the CP ranks (dp = 1): the whole batch's; names without the AC wrappers
    grads = {n.replace(_CHECKPOINT_PREFIX, ""): g for n, g in canonical_grads(model).items()}
    errors = {"logits": _rel(logits.detach(), ref_logits.detach()[:, positions])}
    errors.update({name: _rel(grads[name], p.grad) for name, p in ref.named_parameters()})
    return {
        "plan": done.cp_plan.describe(),
        "order": order,
        "errors": errors,
        "fsdp_mesh": done.fsdp_mesh.size(),
    }


def test_tp_cp_ac_fsdp_in_one_call_equal_one_process() -> None:
    for rank, result in enumerate(run_ranks(_composed_worker, 4, timeout_s=400)):
        assert result["plan"] == "mode=p2p layout=head_tail"
        assert result["order"] == {"fsdp": True, "ac": True, "cp": True, "tp": True}, (rank, result["order"])
        assert result["fsdp_mesh"] == 2  # the (dp, cp) ranks of this TP rank
        assert len(result["errors"]) > 20
        for name, err in result["errors"].items():
            assert err <= 1e-6, f"rank {rank} {name}: relative error {err:.1e}"


def _snapshot(model: torch.nn.Module, ids: torch.Tensor) -> tuple:
    with torch.no_grad():
        logits = model(ids)
    state = {n: t.clone() for n, t in model.state_dict().items()}
    return logits, state, [type(m).__name__ for m in model.modules()]


def _unchanged(model: torch.nn.Module, before: tuple, ids: torch.Tensor) -> bool:
    logits, state, kinds = before
    now = _snapshot(model, ids)
    return (
        torch.equal(now[0], logits)
        and now[1].keys() == state.keys()
        and all(type(now[1][n]) is torch.Tensor and torch.equal(now[1][n], t) for n, t in state.items())
        and now[2] == kinds
        and not any(is_parallelized(m) for _, m in mixers_of(text_model_of(model)))
    )


def _refusal(model: torch.nn.Module, mesh: Any, config: ParallelConfig, ids: torch.Tensor) -> dict[str, Any]:
    before = _snapshot(model, ids)
    try:
        parallelize(model, mesh, config)
    except (ValueError, NotImplementedError, RuntimeError) as error:
        return {"error": f"{type(error).__name__}: {error}", "unchanged": _unchanged(model, before, ids)}
    return {"error": None, "unchanged": _unchanged(model, before, ids)}


def _refusals_worker(rank: int, world: int) -> dict[str, dict[str, Any]]:
    import hyperpar_gdn.parallel.fsdp as fsdp

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    ids = torch.randint(0, 61, (1, T), generator=torch.Generator().manual_seed(1))
    found = {}
    # 2 value heads: ulysses at cp 2 splits the whole layer's, not a TP rank's single head
    found["tp_heads"] = _refusal(_model(value_heads=2), mesh, ParallelConfig(tp=2, cp_mode="ulysses"), ids)
    # rank 1 alone asks for expert parallelism of a model without MoE blocks
    alone = ParallelConfig(tp=2, cp_mode="p2p", ep=2 if rank == 1 else 1)
    found["one_rank"] = _refusal(_model(), mesh, alone, ids)
    mode = "all_gather" if rank == 3 else "p2p"  # rank 3 launched with another mode
    found["differ"] = _refusal(_model(), mesh, ParallelConfig(tp=2, cp_mode=mode), ids)
    # FSDP fails while applying: CP and activation checkpointing are undone
    data = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("fully_shard failed")

    original, fsdp.apply_fsdp = fsdp.apply_fsdp, broken
    try:
        config = ParallelConfig(cp_mode="p2p", activation_checkpointing=True, fsdp=True)
        found["undone"] = _refusal(_model(), data, config, ids)
    finally:
        fsdp.apply_fsdp = original
    return found


@pytest.fixture(scope="module")
def refusals() -> list[dict[str, dict[str, Any]]]:
    return run_ranks(_refusals_worker, 4, timeout_s=400)


def test_a_mode_the_tp_ranks_heads_cannot_run_is_refused_before_tp(refusals: list) -> None:
    for rank, found in enumerate(refusals):
        result = found["tp_heads"]
        assert result["unchanged"], rank
        assert result["error"].startswith("ValueError: layer 0: "), result["error"]
        assert "ulysses" in result["error"] and "tp" in result["error"], result["error"]


def test_one_rank_refusing_stops_every_rank_before_any_change(refusals: list) -> None:
    for rank, found in enumerate(refusals):
        result = found["one_rank"]
        assert result["unchanged"], rank
        if rank == 1:
            assert result["error"] == (
                "ValueError: expert parallelism at ep=2: the model has no MoE block"
            ), result["error"]
        else:
            assert result["error"].startswith("ValueError: ranks [1] refused their set-up"), result["error"]


def test_ranks_given_different_setups_all_stop(refusals: list) -> None:
    for rank, found in enumerate(refusals):
        result = found["differ"]
        assert result["unchanged"], rank
        assert result["error"] == (
            "ValueError: the ranks were given different set-ups (ranks [0, 1, 2]; ranks [3] agree among "
            "themselves): launch every rank with the same ParallelConfig, mesh and model"
        ), result["error"]


def test_a_failure_while_applying_undoes_cp_and_checkpointing(refusals: list) -> None:
    for rank, found in enumerate(refusals):
        assert found["undone"] == {"error": "RuntimeError: fully_shard failed", "unchanged": True}, rank


def _experts_fsdp_worker(rank: int, world: int) -> dict[str, Any]:
    from tiny_models import tiny_model

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    model = tiny_model(moe=True, num_experts=4)  # 2 experts per rank at ep 2; 2I = 48, C = 32
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        parallelize(model, mesh, ParallelConfig(ep=2, fsdp=True, cp_mode="p2p"))
    except ValueError as error:
        message = str(error)
    else:
        message = ""
    after = dict(model.named_parameters())
    unchanged = all(
        type(after[n]) is torch.nn.Parameter and torch.equal(after[n], t) for n, t in before.items()
    )
    return {"message": message, "unchanged": unchanged}


def test_experts_fsdp_cannot_cut_is_refused_before_expert_parallelism() -> None:
    """6 ranks, ep 2: 3 replicas of 2 experts [2, 48, 32] and [2, 32, 24]: refused by the checks,
    before the experts are split (expert parallelism has no undo)."""
    for result in run_ranks(_experts_fsdp_worker, 6, timeout_s=400):
        assert result == {
            "message": "FSDP over 3 expert replicas: this rank's experts (down_proj [2, 32, 24], gate_up_proj "
            "[2, 48, 32]) divide by 3 neither by expert (dim 0) nor along dim 1",
            "unchanged": True,
        }
