"""The README's MindSpore command prints this project's lines, not MindSpore's: under 40 lines on
the console, no [WARNING] or [ERROR] line from the workers, the framework's lines in the log
directory instead."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from msrun_harness import msrun_available

ROOT = Path(__file__).resolve().parents[2]


def _readme_command() -> list[str]:
    """The MindSpore training command of README.md, as written there."""
    text = (ROOT / "README.md").read_text()
    line = re.search(
        r"HP_PLATFORM=mindspore (?:OMP_NUM_THREADS=1 )?(msrun [^`\n]*scripts/train\.py[^`\n]*)", text
    )
    assert line, "README.md lost its MindSpore command"
    return line[1].split()


@pytest.mark.skipif(not msrun_available(), reason="MindSpore is not installed")
@pytest.mark.timeout(400)
def test_readme_mindspore_command_output(tmp_path: Path) -> None:
    command = _readme_command()
    assert command[0] == "msrun" and "--log-every" in command, command
    with socket.socket() as sock:  # msrun's default port may be taken by another job
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [
        sys.executable,
        str(Path(sys.executable).parent / "msrun"),
        f"--master_port={port}",
        *command[1:],
    ]
    command = [c.replace("scripts/train.py", str(ROOT / "scripts" / "train.py")) for c in command]
    command += ["--steps", "3", "--seq-len", "32", "--batch-size", "2"]  # short: the output's form
    env = {k: v for k, v in os.environ.items() if not k.startswith("GLOG_")}
    path = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # msrun runs "python"
    env.update(HP_PLATFORM="mindspore", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PATH=path)
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=360)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    lines = out.splitlines()
    assert len(lines) < 40, out
    assert len([line for line in lines if not line.startswith("[rank ")]) <= 10, out  # beyond our own
    workers = [
        line
        for line in lines
        if re.match(r"\[(WARNING|ERROR)\] \w+\((?!\d+:\d+,MainProcess\):.*_api\.py)", line)
    ]
    assert not [line for line in workers if "process_entity" not in line], out  # msrun's own line only
    assert any(line.startswith("[rank 0] done: steps 1..3") for line in lines), out
    assert (tmp_path / "msrun_log" / "rank_0" / "stderr.log").stat().st_size > 0
