"""The planning room imports no framework: every module of ``hyperpar_gdn.planning`` loads in a
fresh interpreter without torch, MindSpore or transformers, and ``HP_PLATFORM`` unset."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

IMPORT_ALL = r"""
import importlib, json, pkgutil, sys
import hyperpar_gdn.planning as planning

names = [info.name for info in pkgutil.walk_packages(planning.__path__, "hyperpar_gdn.planning.")]
for name in names:
    importlib.import_module(name)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "mindspore", "transformers"))
print(json.dumps({"imported": names, "frameworks": loaded}))
"""


@pytest.mark.timeout(120)
def test_every_planning_module_imports_without_a_framework() -> None:
    environ = {k: v for k, v in os.environ.items() if k != "HP_PLATFORM"}
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL], capture_output=True, text=True, timeout=100, cwd=ROOT,
        env={**environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert {"hyperpar_gdn.planning.choice", "hyperpar_gdn.planning.tp_rules"} <= set(report["imported"])
    assert report["frameworks"] == []
