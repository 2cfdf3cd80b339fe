"""scripts/train.py with a two-level mode in the head_tail layout under torchrun: 4 ranks as 2 nodes
of 2 (ulysses inside, p2p across), the built-in model (softmax-attention layers), 3 steps; rank
0's copy without CP (``--check-parity``) gives the same losses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from distributed_harness import run_script


@pytest.mark.timeout(240)
def test_two_level_head_tail_trains_as_one_process(tmp_path: Path) -> None:
    metrics_path = tmp_path / "metrics.json"
    options = (
        "--steps 3 --seq-len 64 --cp-size 4 --cp-mode ulysses+p2p --cp-inner-size 2 --cp-layout head_tail"
    )
    done = run_script(
        "scripts/train.py",
        *options.split(),
        "--check-parity",
        "--metrics-json",
        str(metrics_path),
        cwd=tmp_path,
        ranks=4,
        timeout=220,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "dp 1 x cp 4 (--cp-mode ulysses+p2p, --cp-inner-size 2, --cp-layout head_tail)" in done.stdout, (
        done.stdout
    )
    assert "[rank 0] parity OK" in done.stdout, done.stdout
    metrics = json.loads(metrics_path.read_text())
    assert len(metrics["losses"]) == 3 and metrics["world_size"] == 4
    assert metrics["parity"]["max_abs_diff"] <= 1e-5, metrics["parity"]
