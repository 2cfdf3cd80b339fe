"""Checkpoints on disk: round trip, clear errors for missing or corrupt files, and a failed save
that leaves the previous checkpoint untouched."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from hyperpar_gdn.train import checkpoint
from hyperpar_gdn.train.checkpoint import (
    CheckpointError,
    load_checkpoint,
    resolve_checkpoint,
    save_checkpoint,
)


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


def test_a_successful_save_replaces_the_checkpoint(tmp_path: Path) -> None:
    directory = save_checkpoint(tmp_path, 7, _parts(1.0), meta={"run": "first"})
    save_checkpoint(tmp_path, 7, _parts(9.0), meta={"run": "second"})
    step, parts, meta = load_checkpoint(directory)
    assert meta == {"run": "second"} and parts["model"]["w"][0, 0].item() == 9.0
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["step"] == 7 and set(manifest["parts"]) == {"model", "optimizer", "train"}
    assert not [p for p in directory.iterdir() if ".tmp-" in p.name]
