"""Checkpoints on disk: round trip, clear errors for missing or corrupt files, a failed save that
leaves the previous checkpoint untouched, a writer killed mid-save that leaves no step, the
fallback past a damaged newest checkpoint, and pruning."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hyperpar_gdn.train.checkpoints import whole as checkpoint
from hyperpar_gdn.train.checkpoints.whole import latest_checkpoint, load_checkpoint, save_checkpoint
from hyperpar_gdn.train.checkpoints.directory import (
    list_checkpoints,
    prune_checkpoints,
    remove_incomplete,
    resolve_checkpoint,
)
from hyperpar_gdn.train.errors import CheckpointError


def _parts(value: float) -> dict[str, object]:
    return {
        "model": {"w": torch.full((3, 4), value)},
        "optimizer": {
            "state": {0: {"step": torch.tensor(5.0)}},
            "param_groups": [{"lr": 1e-3, "params": [0]}],
        },
        "train": {"step": 5},
    }


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_round_trip_and_latest_step(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 5, _parts(1.0), meta={"config": {"lr": 1e-3}})
    save_checkpoint(tmp_path, 12, _parts(2.0), meta={"config": {"lr": 1e-3}})
    assert sorted(p.name for p in (tmp_path / "step-12").iterdir()) == [
        "manifest.json",
        "model.pt",
        "optimizer.pt",
        "train.pt",
    ]
    assert resolve_checkpoint(tmp_path) == tmp_path / "step-12"
    step, parts, meta = load_checkpoint(tmp_path)
    assert step == 12 and meta == {"config": {"lr": 1e-3}}
    assert torch.equal(parts["model"]["w"], torch.full((3, 4), 2.0))
    assert parts["optimizer"]["param_groups"][0]["lr"] == 1e-3
    step, parts, _ = load_checkpoint(tmp_path / "step-5")
    assert step == 5 and parts["model"]["w"][0, 0].item() == 1.0


def test_missing_checkpoints_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=f"checkpoint {tmp_path / 'nope'} does not exist"):
        load_checkpoint(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="holds no step-N checkpoint directory"):
        load_checkpoint(tmp_path)
    directory = save_checkpoint(tmp_path, 1, _parts(1.0), meta={})
    (directory / "optimizer.pt").unlink()
    with pytest.raises(CheckpointError, match=f"checkpoint file {directory / 'optimizer.pt'} is missing"):
        load_checkpoint(directory)
    (directory / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="manifest.json is missing: .* not a complete checkpoint"):
        load_checkpoint(directory)


@pytest.mark.parametrize("damage", ["flip", "truncate", "manifest"])
def test_corrupt_checkpoints_are_clear_errors(tmp_path: Path, damage: str) -> None:
    directory = save_checkpoint(tmp_path, 3, _parts(1.0), meta={})
    model = directory / "model.pt"
    if damage == "flip":
        data = bytearray(model.read_bytes())
        data[len(data) // 2] ^= 0x01
        model.write_bytes(bytes(data))
        expected = f"checkpoint file {model} is corrupt"
    elif damage == "truncate":
        model.write_bytes(model.read_bytes()[:100])
        expected = f"checkpoint file {model} is corrupt: 100 bytes"
    else:
        (directory / "manifest.json").write_text('{"step": 3, "parts": ')
        expected = "manifest.json is corrupt: JSONDecodeError"
    with pytest.raises(CheckpointError, match=expected):
        load_checkpoint(directory)


@pytest.mark.parametrize("fail_at", [1, 2, 4], ids=["first-part", "second-part", "manifest"])
def test_a_failed_save_leaves_the_original_files_intact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail_at: int
) -> None:
    directory = save_checkpoint(tmp_path, 7, _parts(1.0), meta={"run": "first"})
    before = _files(directory)
    calls = []
    real_fsync = os.fsync

    def failing_fsync(fd: int) -> None:  # the disk fills up while file number `fail_at` is written
        calls.append(fd)
        if len(calls) == fail_at:
            raise OSError(28, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(checkpoint.os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="No space left on device"):
        save_checkpoint(tmp_path, 7, _parts(9.0), meta={"run": "second"})
    monkeypatch.undo()
    assert len(calls) == fail_at
    assert _files(directory) == before  # no original replaced, no temporary file left behind
    step, parts, meta = load_checkpoint(directory)
    assert step == 7 and meta == {"run": "first"} and parts["model"]["w"][0, 0].item() == 1.0


def test_a_refused_rename_of_a_re_save_puts_the_old_checkpoint_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The old step-7 is moved aside, then moving the new one in fails: step-7 is the old one again."""
    directory = save_checkpoint(tmp_path, 7, _parts(1.0), meta={"run": "first"})
    real_rename = os.rename

    def failing_rename(src: str | Path, dst: str | Path) -> None:
        if ".tmp-" in str(src):
            raise OSError(13, "Permission denied")
        real_rename(src, dst)

    monkeypatch.setattr(checkpoint.os, "rename", failing_rename)
    with pytest.raises(OSError, match="Permission denied"):
        save_checkpoint(tmp_path, 7, _parts(9.0), meta={"run": "second"})
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["step-7"]
    step, parts, meta = load_checkpoint(directory)
    assert step == 7 and meta == {"run": "first"} and parts["model"]["w"][0, 0].item() == 1.0


def test_a_successful_save_replaces_the_checkpoint(tmp_path: Path) -> None:
    directory = save_checkpoint(tmp_path, 7, _parts(1.0), meta={"run": "first"})
    save_checkpoint(tmp_path, 7, _parts(9.0), meta={"run": "second"})
    step, parts, meta = load_checkpoint(directory)
    assert meta == {"run": "second"} and parts["model"]["w"][0, 0].item() == 9.0
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["step"] == 7 and set(manifest["parts"]) == {"model", "optimizer", "train"}
    assert not [p for p in directory.iterdir() if ".tmp-" in p.name]


def test_latest_checkpoint_skips_a_damaged_newest_one(tmp_path: Path) -> None:
    for step in (2, 4, 6):
        save_checkpoint(tmp_path, step, _parts(float(step)), meta={"step": step})
    (tmp_path / "step-6" / "model.pt").write_bytes(b"truncated")
    (tmp_path / "step-4" / "optimizer.pt").unlink()
    warnings: list[str] = []
    directory, step, parts, meta = latest_checkpoint(tmp_path, warn=warnings.append)
    assert (directory, step, meta) == (tmp_path / "step-2", 2, {"step": 2})
    assert parts["model"]["w"][0, 0].item() == 2.0
    assert len(warnings) == 2
    assert (
        f"skipping checkpoint {tmp_path / 'step-6'}: checkpoint file {tmp_path / 'step-6' / 'model.pt'}"
        in (warnings[0])
    )
    assert f"checkpoint file {tmp_path / 'step-4' / 'optimizer.pt'} is missing" in warnings[1]
    (tmp_path / "step-2" / "manifest.json").unlink()
    assert (
        latest_checkpoint(tmp_path, warn=warnings.append) is None
        and "manifest.json is missing" in warnings[-1]
    )
    assert latest_checkpoint(tmp_path / "absent", warn=warnings.append) is None


_BLOCKED_SAVE = """
import os, sys, time, torch
from hyperpar_gdn.train.checkpoints import whole as checkpoint
root = sys.argv[1]
checkpoint.save_checkpoint(root, 1, {"model": {"w": torch.ones(2)}}, meta={})
def stuck(src, dst):  # the writer is killed before it renames step-2 into place
    print("renaming", flush=True)
    time.sleep(600)
checkpoint.os.rename = stuck
checkpoint.save_checkpoint(root, 2, {"model": {"w": torch.zeros(2)}}, meta={})
"""


def test_a_writer_killed_before_the_rename_leaves_no_step(tmp_path: Path) -> None:
    """A real process killed (SIGKILL) with every file of step-2 written but not yet renamed."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    writer = subprocess.Popen(
        [sys.executable, "-c", _BLOCKED_SAVE, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert writer.stdout is not None and writer.stdout.readline() == "renaming\n"
        temp = tmp_path / f".step-2.tmp-{writer.pid}"
        assert (temp / "manifest.json").is_file() and (temp / "model.pt").is_file()
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    assert [step for step, _ in list_checkpoints(tmp_path)] == [1]
    found = latest_checkpoint(tmp_path, warn=pytest.fail)
    assert found is not None and found[1] == 1 and found[2]["model"]["w"].tolist() == [1.0, 1.0]
    assert remove_incomplete(tmp_path) == [temp] and not temp.exists()


def test_prune_keeps_the_newest_up_to_the_step_just_saved(tmp_path: Path) -> None:
    for step in (1, 2, 3, 9):
        save_checkpoint(tmp_path, step, _parts(1.0), meta={})
    removed = prune_checkpoints(tmp_path, 2, up_to=3)  # step-9 belongs to an earlier, longer run
    assert removed == [tmp_path / "step-1"]
    assert [step for step, _ in list_checkpoints(tmp_path)] == [2, 3, 9]
    with pytest.raises(ValueError, match="keep_last must be >= 1; got 0"):
        prune_checkpoints(tmp_path, 0, up_to=3)
