"""bench_trace_scale at cp = 16 (the docs record 128, 256 and 1024): one rank at a time of a
Qwen3.5-27B GDN layer traced on fake CUDA tensors sends exactly the cost model's bytes per rank,
and scan's first rank sends in ceil(log2 cp) rounds (plus its conv halo)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_traced_bytes_equal_the_cost_model(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "scripts/bench_trace_scale.py", "--cps", "16", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "trace_scale.json").read_text())
    assert {(r["rank"], r["mode"]) for r in rows} == {
        (r, m) for r in (0, 8, 15) for m in ("p2p", "all_gather", "scan")
    }
    for r in rows:
        assert r["bytes"] == r["predicted_bytes"] > 0, r
    scan = {r["rank"]: r for r in rows if r["mode"] == "scan"}
    assert scan[0]["sends"] == math.ceil(math.log2(16)) + 1, scan[0]
    gathered = {r["rank"]: r["largest_summary_bytes"] for r in rows if r["mode"] == "all_gather"}
    assert gathered[0] == 16 * 48 * 128 * 256 * 4  # every rank's map, held at once
