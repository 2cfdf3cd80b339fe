"""MindSpore's platform ends its process group without an error in MindSpore's own log: groups of
one rank (a one-rank CP mesh beside the world, as generate.py's cp=1 timing builds) have no
device communicator, and ``destroy()`` leaves them to ``release()`` instead of destroying them."""

from __future__ import annotations

from pathlib import Path

import pytest
from msrun_harness import msrun_available

from hyperpar_gdn.platform.msrun import run_msrun

WORKER = """
from hyperpar_gdn.platform import get_platform

platform = get_platform()
platform.init_distributed()
for ranks in ([0, 1], [0], [1]):
    platform.new_group(ranks)
platform.destroy()
print(f"rank {platform.rank()}: destroyed", flush=True)
"""


@pytest.mark.skipif(not msrun_available(), reason="MindSpore is not installed")
@pytest.mark.timeout(300)
def test_destroy_logs_no_failed_group(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    outcome = run_msrun(script, 2, timeout_s=240, log_lines=400)
    logs = "\n".join(outcome.logs.values())
    assert outcome.returncode == 0, logs
    assert "rank 0: destroyed" in logs and "rank 1: destroyed" in logs, logs
    assert "Failed to destroy" not in logs, logs
