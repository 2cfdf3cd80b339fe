"""Whole models in the head_tail layout (rank r holds pieces r and 2cp-1-r of 2*cp) under every
mode, cp 2 and 4, real gloo ranks: logits shard and every parameter gradient (summed over ranks)
equal the one-process model. Batches come from ``shard_for_context_parallel(..., layout=
"head_tail")``: packed documents that cross piece boundaries (transformers' restarting
``position_ids``; ``cu_seqlens`` for HybridLM) against each document run alone, and padding
against transformers' model with its attention mask. A batch cut for another layout is refused
on every rank. Tolerances as in test_models_varlen (fp32 RoPE angles and GDN gates)."""

from __future__ import annotations

import copy

import pytest
import torch
from distributed_harness import run_ranks
from test_models_varlen import _hybrid
from tiny_models import tiny_model

from hyperpar_gdn import apply_context_parallel, init_device_mesh, shard_for_context_parallel
from hyperpar_gdn.distributed.layout import TokenLayout

MODES = ("ulysses", "ulysses_hidden", "p2p", "all_gather")
T = 96  # pieces of 24 (cp 2) and 12 (cp 4)
CU = (
    0,
    2,
    30,
    70,
    96,
)  # 2..30 crosses 12 and 24, 30..70 crosses 36, 48 and 60 (and the head/tail turn at cp 2)
TOL = {"hybrid": 1e-6, "transformers": 1e-5}


def _logits(model: torch.nn.Module, kind: str, **inputs: object) -> torch.Tensor:
    if kind == "hybrid":
        return model(inputs["input_ids"], **{k: v for k, v in inputs.items() if k != "input_ids"})
    return model(**inputs, use_cache=False).logits


def _reference(model: torch.nn.Module, kind: str, ids, weight, mask) -> tuple:
    """One process: each packed document alone (mask None), or the padded batch whole."""
    model.zero_grad()
    if mask is None:
        logits = torch.cat(
            [_logits(model, kind, input_ids=ids[:, a:b]) for a, b in zip(CU[:-1], CU[1:], strict=True)], 1
        )
    else:
        logits = _logits(model, kind, input_ids=ids, attention_mask=mask)
    (logits * weight).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _worker(rank: int, world: int, kind: str) -> dict[str, float]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    base = _hybrid() if kind == "hybrid" else tiny_model(moe=False)
    gen = torch.Generator().manual_seed(2)
    index = torch.as_tensor(TokenLayout.of("head_tail", [T // world] * world).positions(rank))
    mask = torch.ones(2, T, dtype=torch.int64)
    mask[0, -31:] = 0  # right padding over several pieces (into rank 0's tail piece)
    mask[1, :5] = 0  # left padding
    cases = {"packed": (torch.randint(0, 61, (1, T), generator=gen), None)}
    if kind == "transformers":  # HybridLM takes no padding mask
        cases["padded"] = (torch.randint(0, 61, (2, T), generator=gen), mask)
    errors = {}
    for case, (ids, padding) in cases.items():
        weight = torch.randn(*ids.shape, 61, generator=gen, dtype=torch.float64)
        if padding is not None:
            weight = weight * padding[..., None]  # padded positions' logits are undefined
        ref_logits, ref_grads = _reference(copy.deepcopy(base), kind, ids, weight, padding)
        packed = {"cu_seqlens": torch.tensor(CU)} if padding is None else {}
        shard = shard_for_context_parallel(mesh, ids, attention_mask=padding, layout="head_tail", **packed)
        if kind == "hybrid":
            inputs = {"input_ids": shard.input_ids, "cu_seqlens": shard.cu_seqlens, "cp_layout": shard.layout}
        else:  # position_ids: global, restarting at every document
            inputs = shard.model_inputs()
        for mode in MODES:
            model = apply_context_parallel(copy.deepcopy(base), mesh, mode=mode, layout="head_tail")
            logits = _logits(model, kind, **inputs)
            (logits * weight[:, index]).sum().backward()
            keep = torch.ones(ids.shape, dtype=torch.bool) if padding is None else padding.bool()
            keep = keep[:, index]
            errors[f"{case}/{mode}/logits"] = (
                (logits.detach() - ref_logits[:, index])[keep].abs().max() / ref_logits.abs().max()
            ).item()
            for name, p in model.named_parameters():
                grad = mesh.platform.collectives.all_reduce_sum(p.grad.clone(), mesh.get_group())
                ref = ref_grads[name]
                errors[f"{case}/{mode}/{name}"] = (
                    (grad - ref).abs().max() / ref.abs().max().clamp_min(1e-300)
                ).item()
    return errors


@pytest.mark.parametrize("kind", ["hybrid", "transformers"])
@pytest.mark.parametrize("world", [2, 4], ids=["cp2", "cp4"])
def test_head_tail_model_equals_one_process(world: int, kind: str) -> None:
    for rank, errors in enumerate(run_ranks(_worker, world, kind, timeout_s=300)):
        assert errors
        for key, err in errors.items():
            tol = 1e-4 if key.endswith(("A_log", "dt_bias")) else TOL[kind]
            assert err <= tol, f"rank {rank} {kind} {key}: relative error {err:.2e} > {tol:.0e}"


def _wrong_layout_worker(rank: int, world: int) -> list[str]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    ids = torch.randint(0, 61, (1, 16))
    messages = []
    for kind, model_layout, batch_layout in (
        ("transformers", "head_tail", "contiguous"),
        ("transformers", "contiguous", "head_tail"),
        ("hybrid", "head_tail", "contiguous"),
    ):
        base = _hybrid() if kind == "hybrid" else tiny_model(moe=False)
        model = apply_context_parallel(base, mesh, mode="p2p", layout=model_layout)
        shard = shard_for_context_parallel(mesh, ids, layout=batch_layout)
        inputs = (
            shard.model_inputs()
            if kind == "transformers"
            else {"input_ids": shard.input_ids, "cp_layout": shard.layout}
        )
        try:
            _logits(model, kind, **inputs)
            messages.append("no error")
        except ValueError as err:
            messages.append(str(err))
    return messages


def test_a_batch_cut_for_another_layout_is_refused_on_every_rank() -> None:
    for messages in run_ranks(_wrong_layout_worker, 2, timeout_s=120):
        assert (
            "cut for cp_layout='contiguous' but the model was parallelized with layout='head_tail'"
            in (messages[0])
        )
        assert (
            "cut for cp_layout='head_tail' but the model was parallelized with layout='contiguous'"
            in (messages[1])
        )
        assert (
            "cut for cp_layout='contiguous' but the model was parallelized with layout='head_tail'"
            in (messages[2])
        )
