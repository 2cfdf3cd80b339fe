"""Process launch for benchmarks: forked gloo ranks, msrun workers, a fresh process per point.

All three use the library's launchers (:mod:`hyperpar_gdn.platform.launch`,
:mod:`hyperpar_gdn.platform.msrun`), the ones the tests use; here they get a benchmark's
defaults: the platform from ``HP_PLATFORM`` (``cpu`` when unset), long timeouts, and failures
raised with every rank's traceback or log.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hyperpar_gdn.platform.launch import run_ranks
from hyperpar_gdn.platform.msrun import run_msrun

__all__ = ["in_fresh_process", "on_msrun", "on_ranks"]


def on_ranks(
    worker: Callable[..., Any], cp: int, *args: Any, threads: int = 1, timeout_s: float = 1800.0
) -> list[Any]:
    """``worker(rank, cp, *args)`` on ``cp`` forked ranks in a real process group, each with
    ``threads`` threads; their return values in rank order (a failing rank raises with its
    traceback; the job is killed after ``timeout_s``). Each call starts fresh processes, so a
    peak-memory measurement is not hidden by an earlier one."""
    env = {"HP_PLATFORM": os.environ.get("HP_PLATFORM", "cpu")}
    return run_ranks(worker, cp, *args, timeout_s=timeout_s, pg_timeout_s=timeout_s, env=env, threads=threads)


def on_msrun(
    script: Path, cp: int, args: Sequence[str], *, threads: int = 1, timeout_s: float = 1800.0
) -> list[dict[str, Any]]:
    """``script args`` on ``cp`` MindSpore workers started by msrun, each with ``threads`` CPU
    kernel threads (``HP_MINDSPORE_THREADS``; the platform binds each worker to its own cores when
    there is a core per worker); what each wrote with
    :func:`hyperpar_gdn.platform.msrun.write_result`, in rank order."""
    env = {"OMP_NUM_THREADS": str(threads), "HP_MINDSPORE_THREADS": str(threads)}
    outcome = run_msrun(script, cp, args, timeout_s=timeout_s, env=env)
    if not outcome.ok:
        raise RuntimeError(f"MindSpore cp={cp} failed:\n{outcome.describe()}")
    return [result for result in outcome.results if result is not None]


def in_fresh_process(
    argv: Sequence[str], *, env: Mapping[str, str] | None = None, timeout_s: float = 1800.0
) -> dict[str, Any] | None:
    """Run ``python argv`` in a new process; the JSON object on its last stdout line, or None if
    it did not finish within ``timeout_s`` (a failure raises with its stderr)."""
    try:
        done = subprocess.run(
            [sys.executable, *argv],
            env={**os.environ, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return None
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed (exit code {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
