"""pyproject.toml's extras: the ``npu`` extra pins the torch-npu release of the pinned torch, and
nothing that CI installs (``.ci/run``) pulls torch-npu in (it breaks ``import torch`` on a
machine without Ascend CANN)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[1]


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_npu_extra_matches_the_pinned_torch() -> None:
    project = _project()
    (torch_pin,) = [d for d in project["dependencies"] if d.startswith("torch")]
    assert project["optional-dependencies"]["npu"] == [torch_pin.replace("torch", "torch-npu", 1)]


def test_ci_never_installs_torch_npu() -> None:
    extras = _project()["optional-dependencies"]
    installs = re.findall(r"pip install[^\n]*?-e '\.\[([\w,]+)\]'", (ROOT / ".ci" / "run").read_text())
    assert installs == ["test,mindspore"], installs
    for name in installs[0].split(","):
        assert not any("npu" in requirement for requirement in extras[name]), (name, extras[name])
