"""pyproject.toml's dependencies follow the frameworks, and CI installs what it should.

- The core depends on numpy alone; torch is the ``torch`` extra (the pinned CPU build), MindSpore
  the ``mindspore`` extra, and no extra but ``torch`` and ``test`` pulls torch (an Ascend machine
  keeps its own torch, a MindSpore machine gets none).
- transformers, accelerate, TRL and datasets: a range (the oldest to the newest release tested) in
  the extras a user installs, its oldest end pinned in the extras of CI's main and fla environments
  (``test``, ``test-fla``), nothing pinned for the environment of the newest releases.
- The ``npu`` extra pins the torch-npu release of the pinned torch, and nothing that CI installs
  (``.ci/run``, ``.ci/mindspore_only``) pulls torch-npu in (it breaks ``import torch`` on a machine
  without Ascend CANN).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[1]


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _name(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower()


def test_core_needs_numpy_alone_and_each_framework_is_an_extra() -> None:
    project = _project()
    extras = project["optional-dependencies"]
    assert [_name(d) for d in project["dependencies"]] == ["numpy"]
    assert extras["torch"] == ["torch==2.13.0"]
    assert "torch==2.13.0" in extras["test"]
    assert [_name(d) for d in extras["mindspore"]] == ["mindspore", "numpy", "safetensors"]
    with_torch = sorted(name for name, reqs in extras.items() if "torch" in {_name(r) for r in reqs})
    assert with_torch == ["test", "torch"], with_torch


def test_npu_extra_matches_the_pinned_torch() -> None:
    (torch_pin,) = _project()["optional-dependencies"]["torch"]
    assert _project()["optional-dependencies"]["npu"] == [torch_pin.replace("torch", "torch-npu", 1)]


def test_ci_installs_the_frameworks_it_tests_and_never_torch_npu() -> None:
    extras = _project()["optional-dependencies"]
    pattern = r"pip install[^\n]*?['\"](?:\.|\$scratch/src)\[([\w,]+)\]['\"]"
    run = re.findall(pattern, (ROOT / ".ci" / "run").read_text())
    mindspore_only = re.findall(pattern, (ROOT / ".ci" / "mindspore_only").read_text())
    assert run == ["test,mindspore"], run
    assert mindspore_only == ["mindspore"], mindspore_only
    assert ".ci/mindspore_only" in (ROOT / ".ci" / "run").read_text()
    for name in {name for line in run + mindspore_only for name in line.split(",")}:
        assert not any("npu" in requirement for requirement in extras[name]), (name, extras[name])


RANGED = ("transformers", "accelerate", "trl", "datasets")


def test_ranges_for_users_and_their_oldest_end_pinned_for_ci() -> None:
    extras = _project()["optional-dependencies"]
    ranges: dict[str, str] = {}
    for extra in ("transformers", "trainer"):
        for requirement in extras[extra]:
            name = _name(requirement)
            if name in RANGED:
                spec = requirement[len(name) :]
                assert re.fullmatch(r">=\d+(\.\d+)*,<\d+(\.\d+)*", spec), requirement
                assert ranges.setdefault(name, spec) == spec, (extra, requirement, ranges[name])
    assert sorted(ranges) == sorted(RANGED), ranges
    for extra in ("test", "test-fla"):
        pinned = [r for r in extras[extra] if _name(r) in ranges]
        assert pinned, extra
        for requirement in pinned:
            name = _name(requirement)
            assert requirement == f"{name}=={ranges[name].split(',')[0][2:]}", (extra, requirement)
    assert not [r for r in extras["test-newest"] if _name(r) in ranges], extras["test-newest"]
    pattern = r"pip install[^\n]*?--upgrade[^\n]*?['\"]\$scratch/src\[([\w,-]+)\]['\"]"
    newest = re.findall(pattern, (ROOT / ".ci" / "newest_env").read_text())
    assert newest == ["torch,trainer,test-newest"], newest
    assert ".ci/newest_env" in (ROOT / ".ci" / "run").read_text()
