"""scripts/device_check.py runs: its --smoke mode (tiny shapes, the native kernel, this CPU) writes
every part, with numbers that could be wrong: the native kernel against the token-by-token
recurrence on packed documents, every CP mode's ranks at cp = 2, 4 and 8 (each rank's shard run
in turn on torch's fake process group) beside the cost model's bytes. The device figures
themselves need a GPU (docs/backends.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hyperpar_gdn.planning.plan import MODES, TWO_LEVEL_MODES

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_smoke_run_writes_every_part(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "device_check.py"), "--smoke", "--out", str(out)],
        capture_output=True, text=True, timeout=280, env=env, cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["smoke"] and result["kernels"] == {"native": None}
    parity = result["parity"]
    assert parity["float32/T=256"]["outputs"] < 1e-5 and parity["float32/T=256"]["states"] < 1e-5, parity
    assert parity["bfloat16/T=256"]["outputs"] < 3e-2, parity
    assert all(v["median_s"] > 0 for v in result["layer"].values()), result["layer"]
    assert result["widened"]["native"]["ratio"] > 0
    modes = result["modes"]
    for cp in (2, 4, 8):
        mine = {k: v for k, v in modes.items() if f"/cp={cp}/" in k}
        names = {k.split("/")[2] for k in mine}
        assert set(MODES) <= names, (cp, names)
        assert (cp >= 4) == (set(TWO_LEVEL_MODES) <= names), (cp, names)
        for key, value in mine.items():
            assert len(value["local_s_per_rank"]) == cp and min(value["local_s_per_rank"]) > 0, key
            assert value["model_comm_bytes_worst_rank"] > 0, key
