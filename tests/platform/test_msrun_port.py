"""run_msrun when the port it picked is taken before msrun's scheduler binds it: the job is stopped
at once and run again on another port (real msrun, 2 MindSpore workers)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

pytest.importorskip("mindspore")

from hyperpar_gdn.platform import msrun  # noqa: E402

WORKER = """
from hyperpar_gdn.platform import get_platform
from hyperpar_gdn.platform.msrun import start_watchdog, write_result

start_watchdog()
platform = get_platform()
platform.init_distributed(timeout_s=60)
write_result(platform.rank(), {"world": platform.world_size()})
"""


@pytest.mark.timeout(240)
def test_a_taken_port_is_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    picked: list[int] = []
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        real = msrun.free_port

        def pick() -> int:
            picked.append(busy if not picked else real())
            return picked[-1]

        monkeypatch.setattr(msrun, "free_port", pick)
        start = time.monotonic()
        outcome = msrun.run_msrun(script, 2, timeout_s=120)
        took = time.monotonic() - start
    assert len(picked) == 2 and picked[0] == busy != picked[1], picked
    assert outcome.returncode == 0 and not outcome.timed_out, outcome.describe()
    assert outcome.results == [{"world": 2}, {"world": 2}], outcome.describe()
    assert took < 100, took  # the first job stopped when its scheduler failed, not at its deadline
