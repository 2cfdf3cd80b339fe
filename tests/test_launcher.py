"""``hyperpar-train`` (hyperpar_gdn/launcher.py): a mistake in the options is one line before any
rank starts; a rank's user error is the run's only line, without torchrun's failure report."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from distributed_harness import script_env

LAUNCHER = [sys.executable, "-m", "hyperpar_gdn.launcher", "--nproc-per-node", "2"]


def _launch(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*LAUNCHER, *args], cwd=cwd, env=script_env(), capture_output=True, text=True, timeout=240
    )


def test_a_bad_option_is_one_line_and_no_rank_starts(tmp_path: Path) -> None:
    result = _launch("--cp-size", "2", "--cp-mode", "ulysses+p2p", "--steps", "1", cwd=tmp_path)
    lines = (result.stdout + result.stderr).splitlines()
    assert lines == [
        "train.py: error: --cp-mode ulysses+p2p requires --cp-inner-size N: the ranks of each inner "
        "(ulysses) group, e.g. one node's"
    ], lines
    assert result.returncode == 2


def test_the_world_and_the_memory_plan_are_checked_before_the_ranks(tmp_path: Path) -> None:
    result = _launch("--cp-size", "4", "--steps", "1", cwd=tmp_path)
    lines = (result.stdout + result.stderr).splitlines()
    assert len(lines) == 1 and lines[0].startswith("train.py: error: ") and "--cp-size 4" in lines[0], lines
    result = _launch("--max-memory-gb", "0.01", "--seq-len", "64", cwd=tmp_path)
    lines = (result.stdout + result.stderr).splitlines()
    assert len(lines) == 1 and "error: the step needs an estimated" in lines[0], lines
    assert result.returncode == 2


@pytest.mark.timeout(300)
def test_a_rank_error_is_the_last_line_and_printed_once(tmp_path: Path) -> None:
    result = _launch("--steps", "1", "--data", "no-such-file.txt", cwd=tmp_path)
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert lines == ["train.py: error: --data no-such-file.txt: no such file or directory"], (
        lines
    )  # no report
    assert result.returncode == 1
