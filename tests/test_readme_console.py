"""The README's MindSpore commands print this project's lines and at most 10 others each (msrun's
own start lines among them): MindSpore's [WARNING]/[INFO] lines go to ``msrun_log/rank_N/``.

Each command runs as README.md writes it, on a free port (``--master_port``), with ``N`` = 2
workers and small sizes appended where the script takes them (the console's form does not depend
on them). ``scripts/train.py``'s command is counted by tests/train/test_train_mindspore_console.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from msrun_harness import msrun_available

from hyperpar_gdn.platform.msrun import free_port

ROOT = Path(__file__).resolve().parents[1]
OTHERS_AT_MOST = 10


def readme_msrun_commands() -> dict[str, list[str]]:
    """README.md's MindSpore commands by script name: the words from ``msrun`` on."""
    text = (ROOT / "README.md").read_text()
    found = re.findall(
        r"HP_PLATFORM=mindspore (?:OMP_NUM_THREADS=1 )?(msrun [^`\n]*?scripts/(\w+\.py)[^`\n]*)", text
    )
    return {script: command.split() for command, script in found}


def _selfcheck_lines(lines: list[str]) -> list[str]:
    """selfcheck.py's table: from its ``platform=`` line to its ``selfcheck: n/m ok`` line."""
    start = next(i for i, line in enumerate(lines) if line.startswith("platform="))
    end = next(i for i, line in enumerate(lines) if line.startswith("selfcheck: "))
    return lines[start : end + 1]


# script -> (options appended, this project's lines of the output, the line that says it passed)
CASES: dict[str, tuple[list[str], Callable[[list[str]], list[str]], str]] = {
    "mindspore_cp_step.py": (
        [],
        lambda lines: [line for line in lines if line.startswith("mindspore_cp_step: ")],
        "mindspore_cp_step: ok",
    ),
    "selfcheck.py": (
        ["--seq-len", "64", "--hidden", "32", "--k-heads", "2", "--v-heads", "4", "--head-dim", "16"],
        _selfcheck_lines,
        "selfcheck: ",
    ),
}


def test_readme_names_the_mindspore_commands_with_their_log_directory() -> None:
    commands = readme_msrun_commands()
    assert {"train.py", *CASES} <= set(commands), sorted(commands)
    for script, command in commands.items():
        assert {"--join=True", "--log_dir=msrun_log"} <= set(command), f"{script}: {command}"


@pytest.mark.skipif(not msrun_available(), reason="MindSpore is not installed")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("script", sorted(CASES))
def test_readme_mindspore_command_prints_its_own_lines(script: str, tmp_path: Path) -> None:
    extra, own_lines, passed = CASES[script]
    command = [word.replace("=N", "=2") for word in readme_msrun_commands()[script]]
    msrun = [sys.executable, str(Path(sys.executable).parent / "msrun"), f"--master_port={free_port()}"]
    command = [*msrun, *[w.replace(f"scripts/{script}", str(ROOT / "scripts" / script)) for w in command[1:]]]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GLOG_")}
    path = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # msrun runs "python"
    env.update(HP_PLATFORM="mindspore", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PATH=path)
    result = subprocess.run(
        [*command, *extra], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    lines = out.splitlines()
    ours = own_lines(lines)
    assert any(line.startswith(passed) for line in ours), out
    others = [line for line in lines if line not in ours]
    assert len(others) <= OTHERS_AT_MOST, f"{len(others)} lines beyond the project's own:\n{out}"
    assert (tmp_path / "msrun_log" / "rank_0" / "stderr.log").stat().st_size > 0  # MindSpore's went there
