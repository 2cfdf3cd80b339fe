"""scripts/train.py under torchrun (2 ranks): a user error prints one line on rank 0, naming what
and where, and exits with code 2; no rank prints a traceback."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from distributed_harness import run_script


def _torchrun(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    options = ["--steps", "2", "--seq-len", "32", "--batch-size", "2", *args]
    return run_script("scripts/train.py", *options, cwd=cwd, timeout=120)


def _corrupt_checkpoint(tmp: Path) -> str:
    step = tmp / "ckpt" / "step-3"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text("{ not json")
    return str(step)


CASES = {
    "bad-value": (lambda tmp: ["--steps", "0"], "--steps must be >= 1; got 0"),
    "unknown-option": (lambda tmp: ["--stepz", "3"], "unrecognized arguments: --stepz 3"),
    "missing-data": (lambda tmp: ["--data", str(tmp / "nope.txt")], "--data {tmp}/nope.txt: no such file"),
    "missing-checkpoint": (
        lambda tmp: ["--resume", str(tmp / "ckpt")],
        "checkpoint {tmp}/ckpt does not exist",
    ),
    "corrupt-checkpoint": (lambda tmp: ["--resume", _corrupt_checkpoint(tmp)], "step-3"),
    "damaged-save-root": (
        lambda tmp: ["--save", str(Path(_corrupt_checkpoint(tmp)).parent)],
        "every checkpoint under --save {tmp}/ckpt (step-3) failed its checks",
    ),
    "missing-model": (lambda tmp: ["--model", str(tmp)], "--model {tmp}: no config.json there"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_user_error_is_one_line(case: str, tmp_path: Path) -> None:
    make_args, expected = CASES[case]
    result = _torchrun(*make_args(tmp_path), cwd=tmp_path)
    assert result.returncode != 0
    ours = [line for line in result.stderr.splitlines() if line.startswith("train.py: error:")]
    assert len(ours) == 1, result.stderr  # rank 0 only (torchrun's summary repeats it as the root cause)
    assert expected.format(tmp=tmp_path) in ours[0], ours[0]
    assert "hyperpar_gdn" not in result.stderr and 'train.py", line' not in result.stderr, result.stderr
