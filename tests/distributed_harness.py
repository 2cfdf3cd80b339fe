"""Launchers for the distributed tests: forked gloo ranks, and scripts under torchrun.

Forked ranks live in the library, :mod:`hyperpar_gdn.platform.launch` (a real gloo process group,
a deadline, tracebacks and stacks of failing ranks); the benchmarks under ``scripts/`` use the same
function, re-exported here under the name the test modules import it by. See its module docstring
for the example and the options.

A script of this checkout as a user starts it (``torchrun --nproc-per-node 2 scripts/train.py
...``): :func:`script_command` builds the command line, :func:`script_env` the environment
(this checkout importable, one thread per process, the CPU platform) and :func:`run_script`
runs it to the end with a timeout. A test that signals or watches the job while it runs starts
``subprocess.Popen`` with the first two, and finds a worker with :func:`worker_pid`::

    result = run_script("scripts/train.py", "--steps", "2", cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from hyperpar_gdn.platform.launch import RankOutcome, RanksFailed, launch_ranks, run_ranks
from hyperpar_gdn.platform.msrun import free_port

__all__ = [
    "ROOT",
    "RankOutcome",
    "RanksFailed",
    "free_port",
    "launch_ranks",
    "run_ranks",
    "run_script",
    "script_env",
    "script_command",
    "worker_pid",
]

ROOT = Path(__file__).resolve().parents[1]


def script_command(script: str, *args: str, ranks: int = 2, launcher: Sequence[str] = ()) -> list[str]:
    """``python -m torch.distributed.run --nproc-per-node <ranks> <launcher> <script> <args>``.

    ``script`` is a path relative to the checkout (``"scripts/train.py"``); ``launcher`` holds
    torchrun's own options (``--max-restarts 1``, a rendezvous); ``ranks=0`` runs the script with
    plain ``python``, without torchrun (``launcher`` must then be empty).
    """
    if ranks < 0:
        raise ValueError(f"ranks={ranks} must be >= 0 (0: plain python without torchrun)")
    if not ranks and launcher:
        raise ValueError(f"launcher={list(launcher)} needs torchrun (ranks >= 1), but ranks=0")
    path = ROOT / script
    if not path.is_file():
        raise FileNotFoundError(f"script {script!r}: no such file under {ROOT}")
    if not ranks:
        return [sys.executable, str(path), *args]
    run = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), *launcher]
    return [*run, str(path), *args]


def script_env(**overrides: str) -> dict[str, str]:
    """This process's environment with this checkout on ``PYTHONPATH``, ``OMP_NUM_THREADS=1`` and
    ``HP_PLATFORM=cpu``; ``overrides`` replace or add variables (``HP_PLATFORM="cuda"``)."""
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HP_PLATFORM": "cpu",
        "PYTHONPATH": str(ROOT),
        **overrides,
    }


def run_script(
    script: str,
    *args: str,
    cwd: Path,
    timeout: float,
    ranks: int = 2,
    launcher: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run :func:`script_command` in ``cwd`` to its end (``timeout`` seconds at most) with
    ``env`` (default :func:`script_env`); stdout and stderr come back as text."""
    return subprocess.run(
        script_command(script, *args, ranks=ranks, launcher=launcher),
        cwd=cwd,
        env=script_env() if env is None else env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def worker_pid(launcher: int, rank: int) -> int | None:
    """The pid of the worker process with ``RANK=rank`` among the children of torchrun's process
    ``launcher`` (read from ``/proc``), or None when none runs now."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if parent != launcher:
                continue
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if f"RANK={rank}".encode() in environ:
            return int(entry.name)
    return None
