"""scripts/train.py stopped by SIGTERM (plain python) or Ctrl-C (SIGINT to torchrun's process
group, as a terminal sends it): one line, on rank 0 only, naming the step reached and the newest
checkpoint under --save; no traceback from this project; the exit code of the signal (128 + N)
without torchrun."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from distributed_harness import script_command, script_env


def _run_until_saved(tmp: Path, signum: int, *, ranks: int) -> tuple[int, str]:
    """Start a long run with a checkpoint every 2 steps; send ``signum`` once one is saved."""
    options = [
        "--steps",
        "5000",
        "--seq-len",
        "32",
        "--batch-size",
        "2",
        "--save",
        "ckpt",
        "--save-every",
        "2",
    ]
    command, env = script_command("scripts/train.py", *options, ranks=ranks), script_env()
    log = tmp / "out.txt"
    with log.open("w") as out:
        proc = subprocess.Popen(
            command, cwd=tmp, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            deadline = time.monotonic() + 150
            while "saved ckpt/step-" not in log.read_text():
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.5)
            os.killpg(proc.pid, signum)  # the whole group, as a terminal's Ctrl-C
            code = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    return code, log.read_text()


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("signum", "ranks"), [(signal.SIGTERM, 0), (signal.SIGINT, 2)], ids=["SIGTERM-python", "SIGINT-torchrun"]
)
def test_stop_is_one_line(tmp_path: Path, signum: int, ranks: int) -> None:
    code, out = _run_until_saved(tmp_path, signum, ranks=ranks)
    lines = [line for line in out.splitlines() if line.startswith("train.py: stopped by")]
    assert len(lines) == 1, out
    match = re.fullmatch(
        rf"train.py: stopped by {signal.Signals(signum).name} at step (\d+) of 5000; "
        r"last checkpoint ckpt/step-(\d+) \(the same command resumes from it\)",
        lines[0],
    )
    assert match, lines[0]
    step, saved = int(match[1]), int(match[2])
    assert (
        saved % 2 == 0 and saved <= step and (tmp_path / "ckpt" / f"step-{saved}" / "manifest.json").is_file()
    )
    assert "hyperpar_gdn" not in out and 'train.py", line' not in out, out
    assert code == (128 + signum if not ranks else 1), out  # torchrun: its own code for a stopped job


def test_a_stop_during_a_sharded_write_is_a_stop_not_a_failed_save(tmp_path: Path) -> None:
    """SIGTERM that lands inside DCP's write: DCP wraps it (and, across ranks, pickles it) in a
    CheckpointException; the writer's settle step raises the stop itself, before any collective."""
    import pickle

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from hyperpar_gdn.cli import Stopped
    from hyperpar_gdn.train.checkpoints.saves import settle

    class StoppedWriter(FileSystemWriter):
        def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
            raise Stopped(signal.SIGTERM)

    copy = pickle.loads(pickle.dumps(Stopped(signal.SIGTERM)))  # how DCP carries it between ranks
    assert copy.signum == signal.SIGTERM and str(copy) == "SIGTERM"
    with pytest.raises(BaseException) as wrapped:
        dcp.save({"w": torch.ones(3)}, storage_writer=StoppedWriter(tmp_path), no_dist=True)
    assert not isinstance(wrapped.value, Stopped)  # DCP's wrapper, holding the stop
    with pytest.raises(Stopped) as raised:
        settle(wrapped.value, "save step-2", backend=None, policy="stop")  # type: ignore[arg-type]
    assert raised.value.signum == signal.SIGTERM
