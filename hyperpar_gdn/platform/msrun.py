"""Launch a script on N MindSpore workers with ``msrun`` (MCCL on CPU) and collect their results.

MindSpore's ranks cannot be forked like :mod:`hyperpar_gdn.platform.launch`'s: MCCL's cluster
needs a scheduler process and workers that its own launcher starts (each in its own session), and
results come back through files rather than pipes. The tests and ``scripts/bench_cp.py`` use it.

:func:`run_msrun` starts ``msrun --worker_num=N --local_worker_num=N`` on a free port with a hard
deadline and returns what every worker wrote: each worker calls :func:`write_result` with a
JSON-able dict, which lands in ``<out_dir>/rank<r>.json``; the test asserts on those. One msrun
start costs 10-20 s here (MindSpore's cluster build and first collective), so a test batches
all its cases into one job per world size.

Nothing hangs: besides ``timeout_s`` for the whole job,

- every worker gets ``HP_MSRUN_DEADLINE`` (a Unix time); :func:`start_watchdog` makes the worker
  exit with code 124 at that time, because msrun starts each worker in its own session and killing
  msrun alone would leave them running;
- the platform's ``init_distributed(timeout_s=...)`` sets ``MS_CPU_COMM_OP_TIMEOUT``, so a
  collective whose peer is gone fails instead of waiting;
- ``msrun --join=True`` kills all workers once one exits non-zero; at the deadline the harness
  sends msrun SIGINT (msrun then kills its workers and scheduler), then SIGKILLs what is left.

Example (a worker script)::

    from hyperpar_gdn.platform.msrun import start_watchdog, write_result
    start_watchdog()
    platform = get_platform(); platform.init_distributed(timeout_s=60)
    write_result(platform.rank(), {"rank": platform.rank()})

and the test::

    outcome = run_msrun(WORKER, 2, ["--flag"], timeout_s=120)
    assert outcome.ok, outcome.describe()
    assert [r["rank"] for r in outcome.results] == [0, 1]
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["MsrunOutcome", "free_port", "msrun_available", "run_msrun", "start_watchdog", "write_result"]

_OUT_DIR_VAR = "HP_MSRUN_OUT_DIR"
_DEADLINE_VAR = "HP_MSRUN_DEADLINE"


@dataclass
class MsrunOutcome:
    """What an msrun job left behind.

    Attributes:
        world_size: the number of workers.
        returncode: msrun's exit code (None if it had to be killed).
        results: per rank, the dict the worker wrote with :func:`write_result` (None if it wrote none).
        timed_out: the deadline passed and the job was killed.
        wall_s: seconds from start to the end of msrun.
        logs: per log file name (``worker_0.log``, ``scheduler.log``, ``msrun``), its last lines.
    """

    world_size: int
    returncode: int | None
    results: list[dict[str, Any] | None]
    timed_out: bool
    wall_s: float
    logs: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out and all(r is not None for r in self.results)

    def describe(self) -> str:
        missing = [rank for rank, r in enumerate(self.results) if r is None]
        lines = [
            f"msrun with {self.world_size} workers: returncode {self.returncode}, timed out {self.timed_out}, "
            f"no result from ranks {missing}, {self.wall_s:.1f} s"
        ]
        for name, text in sorted(self.logs.items()):
            lines.append(f"----- {name} (last lines) -----\n{text.rstrip()}")
        return "\n".join(lines)


def msrun_available() -> bool:
    """MindSpore (and so its msrun launcher) is importable."""
    try:
        import mindspore.parallel.cluster.run  # noqa: F401
    except ImportError:
        return False
    return True


def free_port() -> int:
    """A port no one listens on now (the kernel's pick, so parallel jobs do not collide)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _read_result(path: Path) -> dict[str, Any] | None:
    """A worker's result file, or None if it wrote none."""
    return json.loads(path.read_text()) if path.exists() else None


def _tail(path: Path, lines: int) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(unreadable)"
    kept = [line for line in text.splitlines() if not line.startswith(("[WARNING]", "[INFO]"))]
    return "\n".join(kept[-lines:])


def run_msrun(
    script: str | os.PathLike[str],
    world_size: int,
    args: Sequence[str] = (),
    *,
    timeout_s: float = 240.0,
    env: Mapping[str, str] | None = None,
    log_lines: int = 60,
) -> MsrunOutcome:
    """Run ``script`` with ``args`` on ``world_size`` msrun workers on this machine.

    Workers get ``HP_PLATFORM=mindspore``, ``GLOG_v=3`` (MindSpore's errors only),
    ``OMP_NUM_THREADS=1``, the output folder and the deadline; ``env`` overrides or adds
    variables. Returns the outcome; raises only if msrun cannot be started at all.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s={timeout_s} must be positive")
    for _ in range(2):  # a second time only when the scheduler's port was taken meanwhile
        outcome = _run_once(script, world_size, args, timeout_s=timeout_s, env=env, log_lines=log_lines)
        if outcome is not None:
            return outcome
    raise RuntimeError(f"msrun's scheduler could not bind a free port twice in a row ({script})")


_PORT_TAKEN = "Failed to create the TCP server"  # MindSpore's scheduler log when its port is in use


def _run_once(
    script: str | os.PathLike[str],
    world_size: int,
    args: Sequence[str],
    *,
    timeout_s: float,
    env: Mapping[str, str] | None,
    log_lines: int,
) -> MsrunOutcome | None:
    """One msrun job (see :func:`run_msrun`); None when its scheduler could not bind the port that
    :func:`free_port` picked (another process took it in between): the job is stopped at once
    instead of its workers waiting for a scheduler until the deadline."""
    work = Path(tempfile.mkdtemp(prefix="hp-msrun-"))
    out_dir, log_dir = work / "results", work / "logs"
    out_dir.mkdir()
    start = time.monotonic()
    deadline = time.time() + timeout_s
    python_bin = str(Path(sys.executable).parent)  # msrun starts workers as "python" from PATH
    child_env = {
        **os.environ,
        "PATH": python_bin + os.pathsep + os.environ.get("PATH", ""),
        "HP_PLATFORM": "mindspore",
        "GLOG_v": os.environ.get("GLOG_v", "3"),
        "OMP_NUM_THREADS": "1",
        _OUT_DIR_VAR: str(out_dir),
        _DEADLINE_VAR: f"{deadline:.3f}",
        **(env or {}),
    }
    command = [
        sys.executable,
        "-m",
        "mindspore.parallel.cluster.run",
        f"--worker_num={world_size}",
        f"--local_worker_num={world_size}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        "--join=True",
        f"--log_dir={log_dir}",
        f"--cluster_time_out={max(int(timeout_s), 1)}",
        str(script),
        *args,
    ]
    msrun_log = work / "msrun.log"
    try:
        with open(msrun_log, "w") as log:
            proc = subprocess.Popen(
                command, env=child_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            state = _wait(proc, log_dir / "scheduler.log", timeout_s + 5)  # workers stop at the deadline
            if state != "exited":
                _stop(proc)
            if state == "port taken":
                return None
            timed_out = state == "timed out"
        results = [_read_result(out_dir / f"rank{rank}.json") for rank in range(world_size)]
        logs = {"msrun": _tail(msrun_log, log_lines)}
        for path in sorted(log_dir.glob("*.log")) if log_dir.exists() else []:
            logs[path.name] = _tail(path, log_lines)
        timed_out = timed_out or any(
            "watchdog: deadline passed" in text for name, text in logs.items() if name != "msrun"
        )
        return MsrunOutcome(
            world_size=world_size,
            returncode=proc.returncode,
            results=results,
            timed_out=timed_out,
            wall_s=time.monotonic() - start,
            logs=logs,
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _wait(proc: subprocess.Popen[bytes], scheduler_log: Path, timeout_s: float) -> str:
    """Wait for msrun: "exited", "timed out", or "port taken" (its scheduler could not listen)."""
    end = time.monotonic() + timeout_s
    while True:
        try:
            proc.wait(timeout=1.0)
            return "exited"
        except subprocess.TimeoutExpired:
            pass
        if scheduler_log.exists() and _PORT_TAKEN in scheduler_log.read_text(errors="replace"):
            return "port taken"
        if time.monotonic() > end:
            return "timed out"


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT msrun (it kills its workers and scheduler), then SIGKILL its process group."""
    try:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=10)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait(timeout=10)


# --- worker side --------------------------------------------------------------------------------


def start_watchdog() -> None:
    """In a worker: exit with code 124 at ``HP_MSRUN_DEADLINE`` (no-op without it)."""
    value = os.environ.get(_DEADLINE_VAR, "").strip()
    if not value:
        return
    remaining = float(value) - time.time()

    def fire() -> None:
        print(f"watchdog: deadline passed (pid {os.getpid()})", flush=True)
        os._exit(124)

    timer = threading.Timer(max(remaining, 0.0), fire)
    timer.daemon = True
    timer.start()


def write_result(rank: int, result: Mapping[str, Any]) -> None:
    """In a worker: write ``result`` (JSON-able) as this rank's result, atomically."""
    out_dir = os.environ.get(_OUT_DIR_VAR, "").strip()
    if not out_dir:
        raise RuntimeError(f"{_OUT_DIR_VAR} is not set: run the worker through run_msrun()")
    path = Path(out_dir) / f"rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, path)
