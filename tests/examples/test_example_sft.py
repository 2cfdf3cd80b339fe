"""examples/sft_qwen35.py as a user runs it: ``torchrun --nproc-per-node 2`` on the tiny model
(CPU, gloo), with fewer steps; the logged loss falls and the saved directory loads back. In
``--cp-mode auto``, ``scan`` and a two-level mode (4 processes) its logged losses equal one
process's (``--cp-size 1``), rank 0 prints one header line, and a refused set-up is one line per
rank without a traceback."""

from __future__ import annotations

import ast
import json
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


# --- every mode the library offers, against one process ---------------------------------------------

STEPS = ["--steps", "3", "--logging-steps", "1"]
TOL = 1e-4  # fp32; AdamW's normalised steps carry a 1e-7 gradient difference a little further
MODE_CASES = {  # name: (processes, options)
    "auto": (2, ["--cp-mode", "auto"]),
    "scan": (2, ["--cp-mode", "scan"]),
    "ulysses+p2p": (4, ["--cp-size", "4", "--cp-mode", "ulysses+p2p", "--cp-inner-size", "2"]),
}


def _losses(out: Path) -> list[float]:
    """The logged training losses of a run's trainer_state.json (full precision)."""
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return [entry["loss"] for entry in history if "loss" in entry]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    out = tmp_path_factory.mktemp("one") / "out"
    options = ["--cp-size", "1", *STEPS, "--output-dir", str(out)]
    result = run_script("examples/sft_qwen35.py", *options, cwd=out.parent, timeout=280, ranks=0)
    assert result.returncode == 0, result.stdout + result.stderr
    return _losses(out)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", MODE_CASES)
def test_sft_example_modes_equal_one_process(case: str, one_process: list[float], tmp_path: Path) -> None:
    processes, options = MODE_CASES[case]
    out = tmp_path / "out"
    result = run_script(
        "examples/sft_qwen35.py", *options, *STEPS, "--output-dir", str(out), cwd=tmp_path, timeout=280,
        ranks=processes,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    headers = [line for line in output.splitlines() if line.startswith("CPSFTTrainer: context parallelism")]
    assert len(headers) == 1, output  # rank 0 only
    cp = processes if case == "ulysses+p2p" else 2
    assert f"cp {cp} x dp 1 ({processes} processes, cpu), mode {case}" in headers[0], headers
    assert "kernel " in headers[0] and "layout " in headers[0], headers
    losses = _losses(out)
    assert len(losses) == len(one_process) == 3, (losses, one_process)
    for got, want in zip(losses, one_process, strict=True):
        assert abs(got - want) <= TOL * abs(want), (case, losses, one_process)


@pytest.mark.timeout(120)
def test_a_refused_setup_is_one_line_per_rank(tmp_path: Path) -> None:
    """A two-level mode without its inner size: each rank says so in one line, with no traceback
    of this project's code (torchrun's own summary follows, naming the same line)."""
    result = run_script("examples/sft_qwen35.py", "--cp-mode", "ulysses+p2p", cwd=tmp_path, timeout=110)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    errors = [line for line in output.splitlines() if re.match(r"\[rank \d\] CPSFTTrainer: error: ", line)]
    assert sorted(line[:8] for line in errors) == ["[rank 0]", "[rank 1]"], output
    assert all("inner_size" in line for line in errors), errors
    assert not re.search(r'File "[^"]*(hyperpar_gdn|examples)/', output), output
