"""Whole models on packed documents under context parallelism (real gloo ranks), every mode: the
logits shard and every parameter gradient (summed over ranks) equal each document run alone on
one device. Our HybridLM with ``cu_seqlens`` (fp64); transformers' Qwen3.5
with packed ``position_ids`` (as ``DataCollatorWithFlattening`` emits) or ``cu_seq_lens_q``
(fp32 gates: docs/maths.md)."""

from __future__ import annotations

import copy

import pytest
import torch
from distributed_harness import run_ranks
from tiny_models import tiny_model

from hyperpar_gdn import apply_context_parallel, init_device_mesh
from hyperpar_gdn.models.lm import HybridLM, HybridLMConfig

MODES = ("ulysses", "ulysses_hidden", "p2p", "all_gather")
T = 96
CU = (0, 2, 30, 70, 96)  # a 2-token document, documents across the shard boundaries 24, 48, 72
# HybridLM: fp64, but RoPE angles are computed in fp32 (as transformers does), and a document run
# alone sits at positions 0.. while packed it sits at its global positions: the same relative
# angles, rounded differently (measured 6e-8). transformers: fp32 gates as well.
TOL = {"hybrid": 1e-6, "transformers": 1e-5}


def _hybrid() -> torch.nn.Module:
    torch.manual_seed(0)
    config = HybridLMConfig(vocab_size=61, hidden_size=32, num_layers=4, linear_num_key_heads=2)
    return HybridLM(config).double()


def _logits(model: torch.nn.Module, ids: torch.Tensor, **kwargs: object) -> torch.Tensor:
    if isinstance(model, HybridLM):
        return model(ids, **kwargs)
    return model(input_ids=ids, use_cache=False, **kwargs).logits


def _per_document(model: torch.nn.Module, ids: torch.Tensor, weight: torch.Tensor) -> tuple:
    model.zero_grad()
    logits = torch.cat([_logits(model, ids[:, a:b]) for a, b in zip(CU[:-1], CU[1:], strict=True)], 1)
    (logits * weight).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _worker(rank: int, world: int, kind: str, packing: str) -> dict[str, float]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    base = _hybrid() if kind == "hybrid" else tiny_model(moe=False)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 61, (1, T), generator=gen)
    weight = torch.randn(1, T, 61, generator=gen, dtype=torch.float64)
    ref_logits, ref_grads = _per_document(copy.deepcopy(base), ids, weight)
    t = T // world
    window = slice(rank * t, (rank + 1) * t)
    if packing == "cu_seqlens":
        kwargs = {"cu_seqlens": torch.tensor(CU)}
    elif packing == "cu_seq_lens_q":
        kwargs = {"cu_seq_lens_q": torch.tensor(CU)}
    else:  # transformers' packed position_ids, this rank's shard
        positions = torch.cat([torch.arange(b - a) for a, b in zip(CU[:-1], CU[1:], strict=True)])[None]
        kwargs = {"position_ids": positions[:, window]}
    errors = {}
    for mode in MODES:
        model = apply_context_parallel(copy.deepcopy(base), mesh, mode=mode)
        logits = _logits(model, ids[:, window], **kwargs)
        (logits * weight[:, window]).sum().backward()
        errors[f"{mode}/logits"] = (
            (logits.detach() - ref_logits[:, window]).abs().max() / ref_logits.abs().max()
        ).item()
        for name, p in model.named_parameters():
            grad = mesh.platform.collectives.all_reduce_sum(p.grad.clone(), mesh.get_group())
            ref = ref_grads[name]
            errors[f"{mode}/{name}"] = ((grad - ref).abs().max() / ref.abs().max().clamp_min(1e-300)).item()
    return errors


@pytest.mark.parametrize(
    "kind, packing",
    [("hybrid", "cu_seqlens"), ("transformers", "position_ids"), ("transformers", "cu_seq_lens_q")],
)
@pytest.mark.parametrize("world", [2, 4], ids=["cp2", "cp4"])
def test_packed_model_equals_each_document_alone(world: int, kind: str, packing: str) -> None:
    for rank, errors in enumerate(run_ranks(_worker, world, kind, packing, timeout_s=240)):
        for key, err in errors.items():
            tol = 1e-4 if key.endswith(("A_log", "dt_bias")) else TOL[kind]
            assert err <= tol, f"rank {rank} {kind} {packing} {key}: relative error {err:.2e} > {tol:.0e}"
