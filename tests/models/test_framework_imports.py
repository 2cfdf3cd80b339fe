"""Which framework each part of the package loads.

- Under ``HP_PLATFORM=mindspore`` the core (``ops``, ``planning``, ``distributed``, ``inference``), the platform's
  MindSpore side, ``HybridLMConfig`` and the MindSpore models import, build and run without torch
  (checked in a fresh interpreter: ``'torch' not in sys.modules``).
- ``hyperpar_gdn.models`` has no import circle, function-level imports included.
- ``HybridLMConfig`` keeps its public names; with ``HP_PLATFORM`` unset and no torch, the platform
  says what to set or install.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# A fresh interpreter imports every module of the MindSpore side, builds the MindSpore platform
# and runs the MindSpore HybridLM once; it prints what it imported and which torch modules loaded.
MINDSPORE_SIDE = r"""
import importlib, json, pkgutil, sys
import hyperpar_gdn

def walk(package):
    module = importlib.import_module(package)
    names = [package]
    if hasattr(module, "__path__"):
        names += [info.name for info in pkgutil.walk_packages(module.__path__, package + ".")]
    return names

names = []
for package in ("hyperpar_gdn.ops", "hyperpar_gdn.planning", "hyperpar_gdn.distributed", "hyperpar_gdn.inference",
                "hyperpar_gdn.models.mindspore", "hyperpar_gdn.models.config",
                "hyperpar_gdn.models.qwen35_config", "hyperpar_gdn.models.safetensors_files",
                "hyperpar_gdn.platform.mindspore_platform", "hyperpar_gdn.platform.mindspore_ops",
                "hyperpar_gdn.platform.mindspore_collectives", "hyperpar_gdn.platform.mindspore_attention",
                "hyperpar_gdn.platform.host_memory", "hyperpar_gdn.tensor_parallel.mindspore_styles",
                "hyperpar_gdn.tensor_parallel.mindspore_apply"):
    names += walk(package)
for name in names:
    importlib.import_module(name)

import mindspore as ms
import numpy as np
from hyperpar_gdn import get_platform
from hyperpar_gdn.models import HybridLMConfig
from hyperpar_gdn.models.mindspore import HybridLM, HybridLMConfig as MindSporeConfig

platform = get_platform()
model = HybridLM(HybridLMConfig(num_layers=4, hidden_size=32, intermediate_size=64, vocab_size=64))
logits = model(ms.Tensor(np.arange(12, dtype=np.int64).reshape(1, 12) % 64))
print(json.dumps({
    "imported": names,
    "platform": platform.name,
    "one_config": MindSporeConfig is HybridLMConfig,
    "logits_shape": list(logits.shape),
    "finite": bool(np.isfinite(logits.asnumpy()).all()),
    "torch_modules": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")),
}))
"""


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "GLOG_v": "3", **env}
    environ = {key: value for key, value in environ.items() if value != ""}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=environ, cwd=ROOT, timeout=240
    )


@pytest.mark.timeout(300)
def test_mindspore_side_runs_without_torch() -> None:
    pytest.importorskip("mindspore")
    done = _run(MINDSPORE_SIDE, HP_PLATFORM="mindspore")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["torch_modules"] == []
    imported = set(report["imported"])
    for name in (
        "hyperpar_gdn.ops.gdn.chunk",
        "hyperpar_gdn.distributed.parallelize",
        "hyperpar_gdn.distributed.cp.state_passing",
        "hyperpar_gdn.inference.prefill",
        "hyperpar_gdn.models.mindspore.lm",
        "hyperpar_gdn.models.mindspore.moe",
        "hyperpar_gdn.models.mindspore.qwen35",
        "hyperpar_gdn.tensor_parallel.mindspore_styles",
        "hyperpar_gdn.tensor_parallel.mindspore_apply",
    ):
        assert name in imported, name
    assert report["platform"] == "mindspore" and report["one_config"]
    assert report["logits_shape"] == [1, 12, 64] and report["finite"]


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (anywhere in the file)."""
    modules = {_module_name(path): path for path in package_dir.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            graph[name] |= {target for target in targets if target in modules and target != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return cycles


def test_models_have_no_import_circle() -> None:
    graph = _import_graph(ROOT / "hyperpar_gdn" / "models")
    assert "hyperpar_gdn.models.mindspore.mlp" in graph["hyperpar_gdn.models.mindspore.moe"]
    assert _cycles(graph) == []
    # the checker finds a circle when there is one
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_hybrid_lm_config_keeps_its_public_names() -> None:
    import hyperpar_gdn.models as models
    from hyperpar_gdn.models import HybridLMConfig
    from hyperpar_gdn.models.config import HybridLMConfig as config_class
    from hyperpar_gdn.models.lm import HybridLMConfig as lm_class

    assert HybridLMConfig is config_class is lm_class
    with pytest.raises(AttributeError, match="HybridLMConfigs"):
        _ = models.HybridLMConfigs


def test_unset_platform_without_torch_says_what_to_do() -> None:
    code = (
        "import sys\nsys.modules['torch'] = None  # as if torch were not installed\n"
        "from hyperpar_gdn.platform import platform_name\n"
        "try:\n    platform_name()\nexcept ModuleNotFoundError as err:\n    print(err)\n"
    )
    done = _run(code, HP_PLATFORM="")
    assert done.returncode == 0, done.stderr
    assert "HP_PLATFORM is unset and torch is not installed" in done.stdout
    assert "HP_PLATFORM=mindspore" in done.stdout and "hyperpar-gdn[torch]" in done.stdout
