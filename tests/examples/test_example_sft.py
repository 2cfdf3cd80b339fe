"""examples/sft_qwen35.py as a user runs it: ``torchrun --nproc-per-node 2`` on the tiny model
(CPU, gloo), with fewer steps; the logged loss falls and the saved directory loads back."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from distributed_harness import run_script

pytest.importorskip("trl")
pytest.importorskip("datasets")


@pytest.mark.timeout(300)
def test_sft_example_runs_and_the_loss_falls(tmp_path: Path) -> None:
    options = ["--steps", "15", "--output-dir", str(tmp_path / "out")]
    result = run_script("examples/sft_qwen35.py", *options, cwd=tmp_path, timeout=280)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    logs = [ast.literal_eval(line) for line in re.findall(r"^\{'loss'.*\}$", result.stdout, flags=re.M)]
    losses = [float(log["loss"]) for log in logs]
    assert len(losses) == 3, output  # logging_steps=5 over 15 steps, printed by rank 0 only
    assert losses[-1] < losses[0] - 0.2, losses
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
