"""The CP plan: one owner of the modes, checked against the model and the mesh before anything
changes, and agreed on by the ranks (real gloo groups)."""

from __future__ import annotations

import ast
import copy
from pathlib import Path

import pytest
import torch
from distributed_harness import run_ranks

from hyperpar_gdn import DeviceMesh, apply_context_parallel, init_device_mesh
from hyperpar_gdn.distributed.decoder_layers import mixers_of
from hyperpar_gdn.distributed.parallel_style import is_parallelized
from hyperpar_gdn.distributed.plan import (
    HEAD_MODES,
    MODE_CHOICES,
    MODES,
    SPECS,
    STATE_MODES,
    TWO_LEVEL_MODES,
    CPPlan,
)
from hyperpar_gdn.models import GatedDeltaNet, HybridLM, HybridLMConfig

LIBRARY = Path(__file__).resolve().parents[2] / "hyperpar_gdn"


def test_mode_properties_are_defined_once() -> None:
    assert set(MODES) | set(TWO_LEVEL_MODES) == set(SPECS)
    assert MODE_CHOICES == (*MODES, *TWO_LEVEL_MODES, "auto")
    assert set(HEAD_MODES) == {m for m in MODES if SPECS[m].state_exchange is None}
    for mode in TWO_LEVEL_MODES:
        spec = SPECS[mode]
        assert spec.two_level and not spec.head_parallel and spec.state_exchange in STATE_MODES
        assert CPPlan(mode=mode, inner_size=2).heads_split_over(8) == 2
    assert CPPlan(mode="ulysses").heads_split_over(8) == 8
    assert CPPlan(mode="scan").heads_split_over(8) is None


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"mode": "ring"}, ValueError, "mode='ring' is not a context-parallel mode; choose one of ulysses"),
        ({"mode": "auto"}, ValueError, "mode='auto' is not a context-parallel mode"),
        ({"mode": "p2p", "layout": "zigzag"}, ValueError, "layout='zigzag' is not a token layout"),
        ({"mode": "p2p", "chunk_size": 0}, ValueError, "chunk_size must be a positive int; got 0"),
        ({"mode": "ulysses+p2p"}, ValueError, "inner_size is given with the two-level modes"),
    ],
)
def test_plan_refuses_bad_fields(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message.replace("+", r"\+")):
        CPPlan(**kwargs)


def test_plan_is_frozen_and_keyword_only() -> None:
    plan = CPPlan(mode="p2p")
    with pytest.raises(AttributeError):
        plan.mode = "scan"  # type: ignore[misc]
    with pytest.raises(TypeError):
        CPPlan("p2p")  # type: ignore[misc]


def test_mode_names_are_spelled_in_one_library_file() -> None:
    """No tuple, list or set of two or more mode names in the library outside plan.py."""
    names = set(MODE_CHOICES)
    found = []
    for path in sorted(LIBRARY.rglob("*.py")):
        if path.name == "plan.py" and path.parent.name == "distributed":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Tuple | ast.List | ast.Set):
                spelled = [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in names]
                if len(spelled) >= 2:
                    found.append(f"{path.relative_to(LIBRARY)}:{node.lineno} {spelled}")
    assert not found, found


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
