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


@pytest.mark.timeout(600)
def test_multi_smoke_runs_every_mode_on_gloo_ranks_against_one_device(tmp_path: Path) -> None:
    """--multi --smoke: the multi-GPU code path on 4 gloo ranks (fp64): every mode, both layouts and
    the two-level modes equal the one-device layer, forward and backward."""
    from hyperpar_gdn.planning.plan import LAYOUTS

    out = tmp_path / "multi.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "device_check.py"), "--multi", "--smoke", "--ranks", "4",
         "--budget-s", "560", "--out", str(out)],
        capture_output=True, text=True, timeout=580, env=os.environ | {"OMP_NUM_THREADS": "1"}, cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert (result["platform"], result["cp"]) == ("cpu", 4)
    cases = result["cases"]
    want = {f"{m}/{layout}" for m in MODES for layout in LAYOUTS} | {
        f"{m}/contiguous/inner=2" for m in TWO_LEVEL_MODES
    }
    assert set(cases) == want, sorted(cases)
    for key, case in cases.items():
        assert case["worst_error"] < 1e-10, (key, case["errors"])
        assert {"output", "dx", "dA_log", "din_proj_qkv.weight"} <= set(case["errors"]), (key, case["errors"])
        assert case["layer_s"] > 0, key


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "--multi needs at least 2 visible GPUs"),
        (["--smoke", "--ranks", "1"], "--ranks=1: --multi needs at least 2"),
    ],
    ids=["no-gpus", "one-rank"],
)
def test_multi_refuses_what_it_cannot_run(tmp_path: Path, extra: list[str], message: str) -> None:
    import torch

    if not extra and torch.cuda.device_count() >= 2:
        pytest.skip("GPUs are visible here: --multi would run")
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "device_check.py"), "--multi", *extra, "--out", str(tmp_path / "x.json")],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 2 and message in run.stderr, run.stderr[-2000:]
    assert not (tmp_path / "x.json").exists()
