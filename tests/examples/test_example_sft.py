"""examples/sft_qwen35.py as a user runs it: ``torchrun --nproc-per-node 2`` on the tiny model
(CPU, gloo), with fewer steps; the logged loss falls and the saved directory loads back."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_sft_example_runs_and_the_loss_falls(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += [
        str(ROOT / "examples" / "sft_qwen35.py"),
        "--steps",
        "15",
        "--output-dir",
        str(tmp_path / "out"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HP_PLATFORM": "cpu", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    logs = [ast.literal_eval(line) for line in re.findall(r"^\{'loss'.*\}$", result.stdout, flags=re.M)]
    losses = [float(log["loss"]) for log in logs]
    assert len(losses) == 3, output  # logging_steps=5 over 15 steps, printed by rank 0 only
    assert losses[-1] < losses[0] - 0.2, losses
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
