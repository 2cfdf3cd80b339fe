"""LinearAttentionContextParallel beyond numerics: transformers' own layer, DTensor input, undo,
bad input (a ValueError on every rank before any communication) and failing peers (an error
naming the collective, never a hang)."""

from __future__ import annotations

import os
import re
import time

import numpy as np
import pytest
import torch
from distributed_harness import launch_ranks, run_ranks
from tiny_models import transformers_gdn_layer

from hyperpar_gdn import DTensor, LinearAttentionContextParallel, Replicate, Shard, init_device_mesh
from hyperpar_gdn.distributed.dtensor import distribute_tensor
from hyperpar_gdn.distributed.verify import compare_with_reference
from hyperpar_gdn.models import GatedDeltaNet
from hyperpar_gdn.platform import get_platform

MODES = ("ulysses", "p2p", "all_gather")


def _transformers_layer() -> torch.nn.Module:
    return transformers_gdn_layer()


def _transformers_worker(rank: int, world: int) -> dict[str, dict[str, float]]:
    platform = get_platform()
    mesh = init_device_mesh("cpu", (world,))
    rng = np.random.default_rng(3)
    x, cot = rng.standard_normal((2, 120, 32)), rng.standard_normal((2, 120, 32))
    mask = np.ones((2, 120))
    mask[1, :9] = 0
    out = {}
    for mode in MODES:
        layer = LinearAttentionContextParallel(mode=mode).apply(_transformers_layer(), mesh)
        out[mode] = compare_with_reference(
            platform, mesh, layer, _transformers_layer(), x, cot, attention_mask=mask
        )
    return out


def test_transformers_layer_wrapped_directly() -> None:
    for rank, per_mode in enumerate(run_ranks(_transformers_worker, 2, timeout_s=120)):
        for mode, errors in per_mode.items():
            assert len(errors) == 2 + 9, errors
            bad = {k: v for k, v in errors.items() if not v <= 1e-4}
            assert not bad, f"rank {rank} {mode}: {bad}"


def _dtensor_undo_worker(rank: int, world: int) -> dict[str, object]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    layer = GatedDeltaNet(32, 2, 4, 16, 8)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    x = torch.randn(2, 40, 32)[:, rank * 20 : (rank + 1) * 20]
    style = LinearAttentionContextParallel(mode="p2p")
    style.apply(layer, mesh)
    plain = layer(x)
    dt_out = layer(DTensor.from_local(x, mesh, [Shard(1)]))
    try:
        style.apply(layer, mesh)
        twice = ""
    except ValueError as err:
        twice = str(err)
    patched_forward = "forward" in vars(layer)
    refused = {}
    for name, placement in {"replicated": Replicate(), "head_tail": Shard(1, layout="head_tail")}.items():
        try:
            layer(DTensor.from_local(x, mesh, [placement]))
            refused[name] = ""
        except ValueError as err:
            refused[name] = str(err)
    LinearAttentionContextParallel.undo(layer)
    after = layer.state_dict()
    # a head_tail style takes a head_tail sequence shard and returns one: its full tensor is the
    # single-device output
    full = torch.randn(2, 40, 32, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = layer(full)
        LinearAttentionContextParallel(mode="all_gather", layout="head_tail").apply(layer, mesh)
        y = layer(distribute_tensor(full, mesh, [Shard(1, layout="head_tail")]))
        LinearAttentionContextParallel.undo(layer)
    return {
        "refused": refused,
        "head_tail_placements": y.placements,
        "head_tail_error": float((y.full_tensor() - expected).abs().max() / expected.abs().max()),
        "dtensor_type": type(dt_out).__name__,
        "dtensor_placements": [str(p) for p in dt_out.placements],
        "dtensor_shape": tuple(dt_out.shape),
        "dtensor_equal": bool(torch.equal(dt_out.to_local(), plain)),
        "twice": twice,
        "patched": patched_forward,
        "restored": "forward" not in vars(layer) and layer(x).shape == x.shape,
        "state_dict_same": before.keys() == after.keys()
        and all(torch.equal(before[k], after[k]) for k in before),
    }


def test_dtensor_input_apply_twice_and_undo() -> None:
    for result in run_ranks(_dtensor_undo_worker, 2, timeout_s=60):
        assert result["dtensor_type"] == "DTensor" and result["dtensor_equal"]
        assert result["dtensor_shape"] == (2, 40, 32)
        assert result["dtensor_placements"] == [str(Shard(1))]
        assert "already has context parallelism" in result["twice"]
        assert result["patched"] and result["restored"] and result["state_dict_same"]
        assert "placements=(Shard(dim=1),)" in result["refused"]["replicated"], result["refused"]
        assert "got placements=(Replicate(),)" in result["refused"]["replicated"]
        assert "got placements=(Shard(dim=1, layout='head_tail'),)" in result["refused"]["head_tail"]
        assert result["head_tail_placements"] == (Shard(1, layout="head_tail"),)
        assert result["head_tail_error"] <= 1e-5, result["head_tail_error"]


BAD_INPUTS = {
    "unknown mode": r"mode='ring' is not a context-parallel mode",
    "mesh not 1-D": r"\(1, 2\)",
    "heads not divisible": r"num_v_heads=3 is not divisible by cp=2 \(num_k_heads=1\)",
    "shard shorter than the halo": r"CP rank 0 has T/cp=2 tokens, fewer than the conv halo W-1=3",
    "one shard shorter than the halo": r"CP rank 1 has T/cp=2 tokens, fewer than the conv halo W-1=3",
    "one shard empty": r"mode='ulysses': the shard of CP rank 0 is empty",
    "wrong hidden size": r"hidden_size=32.*\(2, 8, 16\)",
    "not a GDN layer": r"Linear is not a Qwen3.5 GDN layer: it lacks hidden_size",
    "mask of the whole sequence": r"attention_mask must be this rank's shard \[B, T/cp\] = \(2, 8\); got \(2, 16\)",
    "cache": r"under context parallelism does not handle cache=",
}


def _bad_input_worker(rank: int, world: int) -> dict[str, str]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    grid = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "cp"))
    torch.manual_seed(0)

    def layer(k_heads: int = 2, v_heads: int = 4) -> GatedDeltaNet:
        return GatedDeltaNet(32, k_heads, v_heads, 16, 8)

    attempts = {
        "unknown mode": lambda: LinearAttentionContextParallel(mode="ring"),
        "mesh not 1-D": lambda: LinearAttentionContextParallel(mode="p2p").apply(layer(), grid),
        "heads not divisible": lambda: LinearAttentionContextParallel(mode="ulysses").apply(
            layer(1, 3), mesh
        ),
        "shard shorter than the halo": lambda: LinearAttentionContextParallel(mode="p2p").apply(
            layer(), mesh
        )(torch.randn(2, 2, 32)),
        # only one rank's input is bad: every rank raises the same error
        "one shard shorter than the halo": lambda: LinearAttentionContextParallel(mode="all_gather").apply(
            layer(), mesh
        )(torch.randn(2, 8 if rank == 0 else 2, 32)),
        "one shard empty": lambda: LinearAttentionContextParallel(mode="ulysses").apply(layer(), mesh)(
            torch.randn(2, 0 if rank == 0 else 8, 32)
        ),
        "one rank's hidden size": lambda: LinearAttentionContextParallel(mode="p2p").apply(layer(), mesh)(
            torch.randn(2, 8, 16 if rank == 0 else 32)
        ),
        "wrong hidden size": lambda: LinearAttentionContextParallel(mode="all_gather").apply(layer(), mesh)(
            torch.randn(2, 8, 16)
        ),
        "not a GDN layer": lambda: LinearAttentionContextParallel(mode="p2p").apply(
            torch.nn.Linear(4, 4), mesh
        ),
        "mask of the whole sequence": lambda: LinearAttentionContextParallel(mode="ulysses").apply(
            layer(), mesh
        )(torch.randn(2, 8, 32), torch.ones(2, 16)),
        "cache": lambda: LinearAttentionContextParallel(mode="p2p").apply(_transformers_layer(), mesh)(
            torch.randn(2, 8, 32), cache=object()
        ),
    }
    messages = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            messages[name] = "no error"
        except (ValueError, NotImplementedError) as err:
            messages[name] = f"{type(err).__name__}: {err}"
    # every rank is still in step: a real CP forward after all the refusals completes
    ok_layer = LinearAttentionContextParallel(mode="all_gather").apply(layer(), mesh)
    messages["after"] = str(tuple(ok_layer(torch.randn(2, 8, 32)).shape))
    return messages


def test_bad_inputs_raise_on_every_rank_without_hanging() -> None:
    results = run_ranks(_bad_input_worker, 2, timeout_s=60, pg_timeout_s=10)
    for rank, messages in enumerate(results):
        for name, pattern in BAD_INPUTS.items():
            assert re.search(pattern, messages[name]), f"rank {rank} {name}: {messages[name]}"
        refused = messages["one rank's hidden size"]
        if rank == 0:
            assert re.search(r"hidden_size=32.*\(2, 8, 16\)", refused), refused
        else:
            assert "ValueError: CP ranks [0] refused their input" in refused, refused
        assert messages["after"] == "(2, 8, 32)"


def _failing_peer_worker(rank: int, world: int, mode: str, when: str) -> str:
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    layer = LinearAttentionContextParallel(mode=mode).apply(GatedDeltaNet(32, 2, 4, 16, 8), mesh)
    x = torch.randn(1, 64, 32, requires_grad=True)
    if rank == 1 and when == "forward":
        raise RuntimeError("rank 1 fails before its forward")
    if rank == 1 and when == "stall":
        mesh.platform.collectives.all_gather_int(64, mesh.get_group())  # the layer's length exchange
        time.sleep(60)  # alive, but never joins the next collective: rank 0 must time out
    y = layer(x)
    if rank == 1 and when == "backward":
        os._exit(7)  # dies between forward and backward
    y.sum().backward()
    return "finished"


@pytest.mark.parametrize(
    ("mode", "when"),
    [("ulysses", "forward"), ("p2p", "backward"), ("all_gather", "backward"), ("p2p", "stall")],
)
def test_failing_peer_gives_a_named_collective_error(mode: str, when: str) -> None:
    outcome = launch_ranks(_failing_peer_worker, 2, mode, when, timeout_s=90, pg_timeout_s=5, grace_s=5)
    assert 0 not in outcome.results, outcome.describe()  # rank 0 could not have finished
    assert 0 in outcome.errors, outcome.describe()  # it failed by itself, within the timeout
    assert outcome.timed_out == ([1] if when == "stall" else []), outcome.describe()
    assert "CollectiveError: collective" in outcome.errors[0], outcome.errors[0]
    assert outcome.wall_s < 60, outcome.describe()
    if when == "backward":
        assert outcome.dead == {1: 7}, outcome.describe()
    elif when == "stall":
        assert "shift_right" in outcome.errors[0] and outcome.wall_s > 4, outcome.describe()
    else:
        assert "rank 1 fails before its forward" in outcome.errors[1]
