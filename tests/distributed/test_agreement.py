"""A CP plan checked against the model and the mesh before anything changes, and agreed on by
the ranks (real gloo groups)."""

from __future__ import annotations

import copy

import pytest
import torch
from distributed_harness import run_ranks

from hyperpar_gdn import DeviceMesh, apply_context_parallel, init_device_mesh
from hyperpar_gdn.distributed.decoder_layers import mixers_of
from hyperpar_gdn.distributed.parallel_style import is_parallelized
from hyperpar_gdn.models import GatedDeltaNet, HybridLM, HybridLMConfig


def _model(num_layers: int = 3) -> torch.nn.Module:
    torch.manual_seed(0)
    config = HybridLMConfig(vocab_size=61, hidden_size=32, num_layers=num_layers, linear_num_key_heads=2)
    return HybridLM(config).double()


def _untouched(model: torch.nn.Module, reference: torch.nn.Module, ids: torch.Tensor) -> bool:
    mixers = [m for _, m in mixers_of(model)]
    if is_parallelized(model) or any(is_parallelized(m) for m in mixers):
        return False
    with torch.no_grad():
        return torch.equal(model(ids), reference(ids))


def _refused_worker(rank: int, world: int) -> dict[str, object]:
    ids = torch.randint(0, 61, (1, 16), generator=torch.Generator().manual_seed(1))
    out: dict[str, object] = {}
    # the last GDN layer has 3 value heads, which ulysses cannot split over 4 ranks
    model = _model()
    block = model.layers[-1]
    block.linear_attn = GatedDeltaNet(32, 1, 3, 16, 16).double()
    reference = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    try:
        apply_context_parallel(model, mesh, mode="ulysses")
    except ValueError as err:
        out["heads"] = str(err)
    out["heads untouched"] = _untouched(model, reference, ids)
    # two levels over CP groups that are no mesh's cp axis: {0, 3} and {1, 2}
    model, reference = _model(), _model()
    platform = mesh.platform
    groups = {tuple(r): platform.new_group(list(r)) for r in ((0, 3), (1, 2))}
    mine = next(r for r in groups if rank in r)
    crossed = DeviceMesh.from_group(platform, groups[mine], list(mine), mesh_dim_name="cp", device_type="cpu")
    try:
        apply_context_parallel(model, crossed, mode="ulysses+p2p", inner_size=2)
    except NotImplementedError as err:
        out["blocks"] = str(err)
    out["blocks untouched"] = _untouched(model, reference, ids)
    return out


@pytest.mark.timeout(120)
def test_refused_plan_leaves_the_model_as_it_was() -> None:
    for rank, out in enumerate(run_ranks(_refused_worker, 4, timeout_s=90)):
        assert "layer 2: mode='ulysses'" in out["heads"], out
        assert "num_v_heads=3 is not divisible by cp=4" in out["heads"], out
        assert "the cp axis of a row-major mesh of the 4 processes" in out["blocks"], out
        assert f"has ranks {[0, 3] if rank in (0, 3) else [1, 2]}" in out["blocks"], out
        assert out["heads untouched"] and out["blocks untouched"], (rank, out)


def _disagreeing_worker(rank: int, world: int) -> dict[str, str]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    cases = {
        "mode": {"mode": ("p2p", "all_gather")[rank]},
        "layout": {"mode": "p2p", "layout": ("contiguous", "head_tail")[rank]},
        "layers": {"mode": "scan"},
        "kernel": {"mode": "p2p", "kernel": ("auto", "native")[rank]},
        "inner": {"mode": "ulysses+p2p", "inner_size": (1, 2)[rank]},
    }
    out = {}
    for name, kwargs in cases.items():
        model = _model(num_layers=2 + rank if name == "layers" else 2)
        try:
            apply_context_parallel(model, mesh, **kwargs)
            out[name] = "applied"
        except ValueError as err:
            out[name] = str(err)
        out[name + " untouched"] = str(not any(is_parallelized(m) for _, m in mixers_of(model)))
    return out


@pytest.mark.timeout(120)
def test_ranks_given_different_plans_stop_together() -> None:
    results = run_ranks(_disagreeing_worker, 2, timeout_s=90)
    assert results[0] == results[1], results  # the same line on both ranks
    out = results[0]
    assert "mode ('p2p' on ranks [0], 'all_gather' on ranks [1])" in out["mode"], out
    assert "layout ('contiguous' on ranks [0], 'head_tail' on ranks [1])" in out["layout"], out
    assert "GDN layers (2 on ranks [0], 3 on ranks [1])" in out["layers"], out
    assert "kernel ('auto' on ranks [0], 'native' on ranks [1])" in out["kernel"], out
    assert "inner_size (1 on ranks [0], 2 on ranks [1])" in out["inner"], out
    assert all(
        out[name + " untouched"] == "True" for name in ("mode", "layout", "layers", "kernel", "inner")
    ), out
