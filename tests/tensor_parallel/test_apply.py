"""Tensor parallelism of whole models (real gloo ranks): logits and every parameter gradient equal
the one-process model.

- tp = 2 alone: transformers' Qwen3.5 (dense and MoE, with and without activation checkpointing)
  and our HybridLM on a batch of 2; the bytes of every TP all-reduce equal docs/tensor_parallel.md's
  formula; per-rank parameters ~0.5x; the whole state in the single-device layout.
- tp = 2 x cp = 2 (4 ranks, mesh (cp, tp)): every one-level CP mode in both layouts and five
  two-level runs on packed documents against each document alone on one process (dense model),
  a mode per layout for MoE and HybridLM; the multimodal model's language model.
- dp 2 x cp 2 x tp 2 (8 ranks, torch mesh): FSDP2 over the flattened (dp, cp) axis, TP, CP.
- tp = 4 over 2 K/V heads (whole K/V projections); a DCP checkpoint saved at tp 2, loaded at
  tp 4; wrong set-ups: every rank raises the same
  one-line error before any communication, the model as it was.
Tolerances as in test_models_varlen (transformers' GDN gates are fp32 in an fp64 model)."""

from __future__ import annotations

import copy

import pytest
import torch
from distributed_harness import run_ranks
from test_models_varlen import _hybrid
from tiny_models import tiny_config, tiny_model

from hyperpar_gdn import (
    apply_context_parallel,
    apply_tensor_parallel,
    init_device_mesh,
    shard_for_context_parallel,
)
from hyperpar_gdn.distributed.layout import TokenLayout
from hyperpar_gdn.models.lm import HybridLM, HybridLMConfig
from hyperpar_gdn.tensor_parallel import (
    canonical_grads,
    canonical_state_dict,
    count_tp_traffic,
    tensor_parallel_plan,
)

CP_MODES = ("ulysses", "ulysses_hidden", "p2p", "all_gather", "scan")
T = 96
CU = (0, 2, 30, 70, 96)  # documents across the pieces of cp = 2 in both layouts
TOL = 1e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def _logits(model: torch.nn.Module, ids: torch.Tensor, **kwargs: object) -> torch.Tensor:
    if isinstance(model, HybridLM):
        return model(ids, **kwargs)
    return model(input_ids=ids, use_cache=False, **kwargs).logits


def _tp_worker(rank: int, world: int, kind: str) -> dict[str, float]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    base = _hybrid() if kind == "hybrid" else tiny_model(moe=kind == "moe")
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 61, (2, 24), generator=gen)
    weight = torch.randn(2, 24, 61, generator=gen, dtype=torch.float64)
    ref = copy.deepcopy(base)
    ref_logits = _logits(ref, ids)
    (ref_logits * weight).sum().backward()
    model = apply_tensor_parallel(copy.deepcopy(base), mesh["tp"])
    with count_tp_traffic() as traffic:
        logits = _logits(model, ids)
        (logits * weight).sum().backward()
    errors = {"logits": _rel(logits.detach(), ref_logits.detach())}
    grads = canonical_grads(model)
    for name, p in ref.named_parameters():
        errors[name] = _rel(grads[name], p.grad)
    state = canonical_state_dict(model)
    errors["state_dict"] = max(_rel(state[n], v) for n, v in base.state_dict().items())
    if kind != "hybrid":  # activation checkpointing: each block's forward (and all-reduce) runs again
        recomputed = apply_tensor_parallel(copy.deepcopy(base), mesh["tp"])
        recomputed.gradient_checkpointing_enable()
        recomputed.train()
        (_logits(recomputed, ids) * weight).sum().backward()
        again = canonical_grads(recomputed)
        errors["checkpointed"] = max(_rel(again[n], p.grad) for n, p in ref.named_parameters())
    blocks = 2 * len(base.model.layers if hasattr(base, "model") else base.layers)
    activation = ids.numel() * base.config.hidden_size * 8  # [B, T, hidden] fp64
    replicated = sum(
        p.numel() * p.element_size()
        for n, p in base.named_parameters()
        if n.endswith(("linear_attn.norm.weight", "q_norm.weight", "k_norm.weight", "mlp.gate.weight"))
        or n.endswith("shared_expert_gate.weight")
    )
    errors["bytes"] = abs(traffic.bytes("output") - blocks * activation)
    errors["bytes"] += abs(traffic.bytes("input_grad") - blocks * activation)
    errors["bytes"] += abs(traffic.bytes("param_grad") - replicated)
    mine = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    layers = sum(p.numel() for n, p in base.named_parameters() if ".layers." in f".{n}" and p.dim() > 1)
    local_layers = sum(
        p.to_local().numel() if hasattr(p, "to_local") else p.numel()
        for n, p in model.named_parameters()
        if ".layers." in f".{n}" and p.dim() > 1
    )
    return {
        **errors,
        "_layer_ratio": local_layers / layers,
        "_ratio": mine / sum(p.numel() for p in base.parameters()),
    }


def _tp_kinds_worker(rank: int, world: int) -> dict[str, dict[str, float]]:
    return {kind: _tp_worker(rank, world, kind) for kind in ("dense", "moe", "hybrid")}


def test_tp2_equals_one_process() -> None:
    """transformers' dense and MoE Qwen3.5 and HybridLM, one process group running each in turn."""
    for rank, by_kind in enumerate(run_ranks(_tp_kinds_worker, 2, timeout_s=300)):
        for kind, errors in by_kind.items():
            ratio, layer_ratio = errors.pop("_ratio"), errors.pop("_layer_ratio")
            assert errors.pop("bytes") == 0, (
                f"rank {rank} {kind}: TP all-reduce bytes differ from the formula"
            )
            for key, err in errors.items():
                assert err <= TOL, f"rank {rank} {kind} {key}: relative error {err:.2e} > {TOL:.0e}"
            # the layers' matrices halve but for the MoE router and shared-expert gate (whole)
            assert 0.49 <= layer_ratio <= 0.53, f"rank {rank} {kind}: layer parameters {layer_ratio:.3f}x"
            assert ratio < 0.8, f"rank {rank} {kind}: per-rank parameters {ratio:.3f}x of one process"


def _reference(model: torch.nn.Module, ids: torch.Tensor, weight: torch.Tensor) -> tuple:
    """Each packed document alone, one process."""
    logits = torch.cat([_logits(model, ids[:, a:b]) for a, b in zip(CU[:-1], CU[1:], strict=True)], 1)
    (logits * weight).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _tp_cp_worker(
    rank: int, world: int, kind: str, runs: tuple[tuple[str, str, int | None], ...]
) -> dict[str, float]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    cp_mesh = mesh["cp"]
    base = _hybrid() if kind == "hybrid" else tiny_model(moe=kind == "moe")
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 61, (1, T), generator=gen)
    weight = torch.randn(1, T, 61, generator=gen, dtype=torch.float64)
    ref_logits, ref_grads = _reference(copy.deepcopy(base), ids, weight)
    errors = {}
    for mode, layout, inner in runs:
        shard = shard_for_context_parallel(cp_mesh, ids, cu_seqlens=torch.tensor(CU), layout=layout)
        index = torch.as_tensor(TokenLayout.of(layout, [T // 2] * 2).positions(cp_mesh.get_local_rank()))
        model = apply_tensor_parallel(copy.deepcopy(base), mesh["tp"])
        apply_context_parallel(model, cp_mesh, mode=mode, layout=layout, inner_size=inner)
        if kind == "hybrid":
            logits = model(shard.input_ids, cu_seqlens=shard.cu_seqlens, cp_layout=shard.layout)
        else:
            logits = model(**shard.model_inputs(), use_cache=False).logits
        (logits * weight[:, index]).sum().backward()
        errors[f"{mode}/{layout}/logits"] = _rel(logits.detach(), ref_logits[:, index])
        for name, grad in canonical_grads(model).items():
            grad = cp_mesh.platform.collectives.all_reduce_sum(grad.clone(), cp_mesh.get_group())
            errors[f"{mode}/{layout}/{name}"] = _rel(grad, ref_grads[name])
    return errors


# (mode, layout, inner_size): every one-level mode in both layouts; two levels with ulysses over
# both CP ranks (inner 2) or over one (inner 1, the state mode across both), in both layouts
DENSE_RUNS = (
    *((mode, layout, None) for layout in ("contiguous", "head_tail") for mode in CP_MODES),
    ("ulysses+p2p", "contiguous", 2),
    ("ulysses+scan", "contiguous", 1),
    ("ulysses+all_gather", "contiguous", 2),
    ("ulysses+p2p", "head_tail", 1),
    ("ulysses+scan", "head_tail", 2),
)
MOE_RUNS = (("p2p", "contiguous", None), ("ulysses", "head_tail", None))
HYBRID_RUNS = (("ulysses_hidden", "contiguous", None), ("scan", "head_tail", None))


def _tp_cp_both_worker(rank: int, world: int) -> dict[str, float]:
    return {
        **{f"dense/{k}": v for k, v in _tp_cp_worker(rank, world, "dense", DENSE_RUNS).items()},
        **{f"moe/{k}": v for k, v in _tp_cp_worker(rank, world, "moe", MOE_RUNS).items()},
        **{f"hybrid/{k}": v for k, v in _tp_cp_worker(rank, world, "hybrid", HYBRID_RUNS).items()},
        "multimodal/logits": _multimodal(mesh_shape=(2, 2)),
    }


def _multimodal(*, mesh_shape: tuple[int, int]) -> float:
    """The language model of transformers' Qwen3_5ForConditionalGeneration (text only) at tp x cp:
    its logits shard against the whole model's (the vision tower stays whole)."""
    import transformers

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("cp", "tp"))
    torch.manual_seed(0)
    config = transformers.Qwen3_5Config(text_config=tiny_config(moe=False).to_dict())
    model = transformers.Qwen3_5ForConditionalGeneration(config).to(torch.float64).eval()
    ids = torch.randint(0, 61, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits
        apply_tensor_parallel(model, mesh["tp"])
        apply_context_parallel(model, mesh["cp"], mode="ulysses")
        shard = shard_for_context_parallel(mesh["cp"], ids)
        local = model(input_ids=shard.input_ids).logits
    t = 32 // mesh_shape[0]
    r = mesh["cp"].get_local_rank()
    return _rel(local, ref[:, r * t : (r + 1) * t])


def test_tp2_cp2_packed_equals_each_document_alone() -> None:
    """Every CP mode in both layouts (dense transformers Qwen3.5), two runs of the MoE model and of
    HybridLM, the multimodal model's language model; one process group."""
    for rank, errors in enumerate(run_ranks(_tp_cp_both_worker, 4, timeout_s=400)):
        assert len(errors) > len(DENSE_RUNS) + len(MOE_RUNS) + len(HYBRID_RUNS)
        for key, err in errors.items():
            tol = 1e-4 if key.endswith(("A_log", "dt_bias")) else TOL
            assert err <= tol, f"rank {rank} {key}: relative error {err:.2e} > {tol:.0e}"


def _tiny_lm(**overrides: int) -> torch.nn.Module:
    import transformers

    config = tiny_config(moe=False)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    return transformers.Qwen3_5ForCausalLM(config).double()


def _error_worker(rank: int, world: int, case: str) -> str:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    model = _tiny_lm(**CASES[case][0])
    before = {n: p.clone() for n, p in model.state_dict().items()}
    try:
        if case == "after_cp":
            apply_context_parallel(model, mesh["cp"], mode="p2p")
        apply_tensor_parallel(model, mesh["tp"])
        before = {n: p.clone() for n, p in model.state_dict().items()}
        apply_context_parallel(model, mesh["cp"], mode="ulysses")
    except ValueError as e:
        unchanged = case == "after_cp" or all(
            torch.equal(before[n], p) for n, p in model.state_dict().items()
        )
        return f"{e} | unchanged={unchanged}"
    return "no error"


CASES = {  # config overrides, the error's words
    "k_heads": ({"linear_num_key_heads": 1}, "num_k_heads=1 is not divisible by tp=2"),
    "after_cp": ({}, "apply tensor parallelism first"),
    "ulysses": ({"linear_num_value_heads": 2}, "num_v_heads=2 is not divisible by tp x cp = 2 x 2"),
}


def _hybrid_tp4_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = HybridLMConfig(vocab_size=61, hidden_size=32, num_layers=4, linear_num_key_heads=4)
    return HybridLM(config).double()


def _dcp_across_tp(rank: int, world: int, directory: str) -> float:
    """A DCP checkpoint of a tp = 2 model (2 replicas) loaded into a tp = 4 model of other weights:
    the whole state then equals the saved model's (the fused rows' order does not depend on tp)."""
    import torch.distributed.checkpoint as dcp

    saved = _hybrid_tp4_model(0)
    expected = {n: v.clone() for n, v in saved.state_dict().items()}
    apply_tensor_parallel(saved, init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"])
    dcp.save(saved.state_dict(), checkpoint_id=directory)
    loaded = apply_tensor_parallel(
        _hybrid_tp4_model(1), init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    )
    state = loaded.state_dict()
    dcp.load(state, checkpoint_id=directory)
    loaded.load_state_dict(state)
    whole = canonical_state_dict(loaded)
    return max(_rel(whole[n], v) for n, v in expected.items())


def _tp4_whole_kv(rank: int, world: int) -> float:
    """HybridLM at tp = 4 with 2 K/V heads: each rank uses the K/V head of its query heads from
    whole K/V projections (their gradients summed); logits and gradients against one process."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    base = _hybrid_tp4_model(0)
    ids = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(4))
    ref = copy.deepcopy(base)
    ref_logits = ref(ids)
    ref_logits.square().sum().backward()
    model = apply_tensor_parallel(copy.deepcopy(base), mesh["tp"])
    logits = model(ids)
    logits.square().sum().backward()
    grads = canonical_grads(model)
    return max(
        _rel(logits.detach(), ref_logits.detach()),
        *(_rel(grads[n], p.grad) for n, p in ref.named_parameters()),
    )


def _errors_worker(rank: int, world: int, directory: str) -> dict[str, object]:
    return {
        "tp4": _tp4_whole_kv(rank, world),
        "dcp": _dcp_across_tp(rank, world, directory),
        **{case: _error_worker(rank, world, case) for case in CASES},
    }


def test_tp4_whole_kv_heads_dcp_and_wrong_setups(tmp_path) -> None:
    """4 ranks: tp = 4 over 2 K/V heads equals one process; a DCP checkpoint saved at tp = 2 loads
    at tp = 4; each wrong set-up fails on every rank with the same one-line error before any
    communication, the model as it was."""
    outcomes = run_ranks(_errors_worker, 4, str(tmp_path / "dcp"), timeout_s=240)
    for rank, outcome in enumerate(outcomes):
        assert outcome.pop("tp4") <= TOL, f"rank {rank}: tp = 4 differs from one process"
        assert outcome.pop("dcp") == 0, f"rank {rank}: the state loaded at tp = 4 is not the saved one"
    for case, (_, words) in CASES.items():
        seen = {o[case] for o in outcomes}
        assert len(seen) == 1, f"{case}: {seen}"  # the same on every rank
        outcome = seen.pop()
        assert words in outcome, outcome
        assert "\n" not in outcome and outcome.endswith("unchanged=True"), outcome


def test_plan_refuses_what_it_does_not_cover() -> None:
    model = tiny_model(moe=False)
    with pytest.raises(
        ValueError, match=r"layer 3: self_attn: num_attention_heads=4 is not divisible by tp=8"
    ):
        tensor_parallel_plan(model.model, 8)
    model.model.layers[0].mlp.down_proj.bias = torch.nn.Parameter(torch.zeros(32, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"layer 0: mlp: down_proj has a bias"):
        tensor_parallel_plan(model.model, 2)
    model = tiny_model(moe=False)
    assert tensor_parallel_plan(model.model, 2)  # transformers' own SiLU passes
    model.model.layers[1].mlp.act_fn = torch.nn.GELU()
    with pytest.raises(ValueError, match=r"layer 1: mlp: activation GELU is not the SiLU of the SwiGLU"):
        tensor_parallel_plan(model.model, 2)


def test_plan_refuses_lora() -> None:
    import peft

    from hyperpar_gdn.distributed.decoder_layers import text_model_of

    for target, where in (
        ("in_proj_z", "layer 0: linear_attn.in_proj_z"),
        ("o_proj", "layer 3: self_attn.o_proj"),
    ):
        model = peft.get_peft_model(tiny_model(moe=False), peft.LoraConfig(r=2, target_modules=[target]))
        with pytest.raises(ValueError, match=rf"{where} is wrapped by peft\.tuners\.lora\.layer\.Linear"):
            tensor_parallel_plan(text_model_of(model), 2)


def _dp_cp_tp_worker(rank: int, world: int) -> float:
    """FSDP2 over the flattened (dp, cp) axis of a torch (dp, cp, tp) = (2, 2, 2) mesh, TP, CP (p2p,
    head_tail), MoE model: each replica half the batch, each CP rank its pieces; the gradients
    (FSDP's mean over the 4 (dp, cp) ranks, times 4) equal one process's on the whole batch."""
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = torch_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
    base = tiny_model(moe=True)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 61, (4, 32), generator=gen)
    weight = torch.randn(4, 32, 61, generator=gen, dtype=torch.float64)
    ref = copy.deepcopy(base)
    (_logits(ref, ids) * weight).sum().backward()
    model = apply_tensor_parallel(copy.deepcopy(base), mesh["tp"])
    apply_context_parallel(model, mesh["cp"], mode="p2p", layout="head_tail")
    data = mesh["dp", "cp"]._flatten("dp_cp")
    for block in model.model.layers:
        fully_shard(block, mesh=data)
    fully_shard(model, mesh=data)
    rows = slice(2 * mesh["dp"].get_local_rank(), 2 * mesh["dp"].get_local_rank() + 2)
    shard = shard_for_context_parallel(mesh["cp"], ids[rows], layout="head_tail")
    index = torch.as_tensor(TokenLayout.of("head_tail", [16, 16]).positions(mesh["cp"].get_local_rank()))
    logits = model(**shard.model_inputs(), use_cache=False).logits
    (logits * weight[rows][:, index]).sum().backward()
    grads = canonical_grads(model)
    return max(_rel(4 * grads[n], p.grad) for n, p in ref.named_parameters())


def test_dp2_cp2_tp2_fsdp2_equals_one_process() -> None:
    for rank, err in enumerate(run_ranks(_dp_cp_tp_worker, 8, timeout_s=400)):
        assert err <= 1e-4, f"rank {rank}: gradients differ from one process by {err:.1e}"  # fp32 gates
