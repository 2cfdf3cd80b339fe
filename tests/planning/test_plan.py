"""The CP plan: one owner of the modes and layouts, a plan that checks itself when built."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from hyperpar_gdn.planning.plan import (
    HEAD_MODES,
    MODE_CHOICES,
    MODES,
    SPECS,
    STATE_MODES,
    TWO_LEVEL_MODES,
    CPPlan,
)

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
        if path.name == "plan.py" and path.parent.name == "planning":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Tuple | ast.List | ast.Set):
                spelled = [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in names]
                if len(spelled) >= 2:
                    found.append(f"{path.relative_to(LIBRARY)}:{node.lineno} {spelled}")
    assert not found, found
