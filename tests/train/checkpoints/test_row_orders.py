"""The row orders of a tensor-parallel model's checkpoints (2 gloo ranks, transformers' Qwen3.5
MoE model, fp64): the specs of ``model_row_orders`` bring the gathered state (parameters and AdamW
moments) to the single-device order that the library's ``canonical_state_dict`` and
``canonical_grads`` give, and a DCP checkpoint of the tp 2 model loads into the model without TP
(the fused rows moved, the ``gate_up_proj`` experts' rows on dim 1 included)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from distributed_harness import run_ranks
from tiny_models import tiny_model

from hyperpar_gdn import apply_tensor_parallel, init_device_mesh
from hyperpar_gdn.tensor_parallel import canonical_grads, canonical_state_dict
from hyperpar_gdn.train.checkpoints.row_orders import model_row_orders, reorder_state
from hyperpar_gdn.train.checkpoints.sharded import load_shards, sharded_state, write_shards
from hyperpar_gdn.train.backends.state_dicts import full_state_dicts


def _step(model: torch.nn.Module, ids: torch.Tensor) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=ids, use_cache=False).logits.square().mean().backward()
    optimizer.step()
    return optimizer


def _worker(rank: int, world: int, directory: str) -> dict[str, float]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    base = tiny_model(moe=True)
    ids = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(0))
    model = apply_tensor_parallel(copy.deepcopy(base), mesh["tp"])
    orders = model_row_orders(model)
    optimizer = _step(model, ids)
    grads = canonical_grads(model)  # the library's single-device layout
    whole = canonical_state_dict(model)
    write_shards(sharded_state(model, optimizer), Path(directory))
    full_model, full_optimizer = full_state_dicts(model, optimizer)  # rank 0 holds them
    reorder_state(full_model, full_optimizer, orders, {})

    plain = copy.deepcopy(base)  # no TP: the single-device order
    plain_optimizer = _step(plain, ids.flip(1))  # other weights and moments, that the load replaces
    load_shards(Path(directory), plain, plain_optimizer, saved_orders=orders, orders={})
    errors = {
        "kinds": float(sorted({spec["kind"] for spec in orders.values()}) == ["gate_up", "qkv"]),
        "loaded": max((plain.state_dict()[n] - v).abs().max().item() for n, v in whole.items()),
    }
    names = {id(p): n for n, p in plain.named_parameters()}
    for p, moments in plain_optimizer.state.items():  # AdamW's first moment of one step: (1 - beta1) g
        errors[f"moment/{names[id(p)]}"] = (moments["exp_avg"] - 0.1 * grads[names[id(p)]]).abs().max().item()
    if rank == 0:
        errors["gathered"] = max((full_model[n] - v).abs().max().item() for n, v in whole.items())
        errors["gathered_moments"] = max(
            (full_optimizer["state"][n]["exp_avg"] - 0.1 * g).abs().max().item() for n, g in grads.items()
        )
    return errors


def test_row_orders_move_state_and_moments_to_the_single_device_order(tmp_path: Path) -> None:
    for rank, errors in enumerate(run_ranks(_worker, 2, str(tmp_path / "dcp"), timeout_s=240)):
        assert errors.pop("kinds") == 1.0, f"rank {rank}: the MoE model's specs lack qkv or gate_up"
        assert len(errors) > 20
        for key, err in errors.items():
            assert err <= 1e-12, f"rank {rank} {key}: differs by {err:.1e}"
