"""A checkpoint is read as data: a run resuming from one whose files hold a pickled object (one
whose unpickling would write a file), with the manifest's digests redone so that every size and
sha256 check passes, stops with one line naming the entry, and the file is never written. On
torch (1 gloo rank): the sharded format's DCP entries and DCP's index, the whole format's parts;
on MindSpore (a 1-rank local world in this process): the small parts of its sharded checkpoint
(its state is JSON and safetensors) and its whole format.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from distributed_harness import run_ranks

from hyperpar_gdn.train import CheckpointError, TrainConfig, Trainer
from hyperpar_gdn.train.checkpoints.directory import file_digest, read_manifest, write_manifest
from hyperpar_gdn.train.checkpoints.sharded import STATE_DIR, load_whole, write_shards

TINY = {"seq_len": 32, "batch_size": 2, "steps": 3, "seed": 5, "save_every": 2}


class WritesAFile:
    """Unpickling this calls ``Path.write_text(marker, "ran")``: what a tampered checkpoint's
    code would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.write_text, (self.marker, "ran"))


def _redo_digests(step: Path) -> None:
    """Rewrite ``step``'s manifest with the size and sha256 of every file as it is now (what a
    tamperer does so that the checks for corruption pass)."""
    manifest = read_manifest(step)
    for entry in manifest["parts"].values():
        entry["bytes"], entry["sha256"] = file_digest(step / entry["file"])
    for name, entry in manifest.get("shards", {}).items():
        entry["bytes"], entry["sha256"] = file_digest(step / name)
    write_manifest(step, manifest)


def _pickled(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _tamper_dcp_entry(step: Path, marker: Path) -> str:
    """The DCP state rewritten with the optimizer's learning rate as the object; its entry."""
    state = load_whole(step / STATE_DIR)
    state["optimizer"]["param_groups"][0]["lr"] = WritesAFile(marker)
    for file in (step / STATE_DIR).iterdir():
        file.unlink()
    write_shards(state, step / STATE_DIR)
    return "checkpoint entry optimizer.param_groups.0.lr"


def _tamper_dcp_index(step: Path, marker: Path) -> str:
    (step / STATE_DIR / ".metadata").write_bytes(pickle.dumps(WritesAFile(marker)))
    return f"checkpoint file {step / STATE_DIR / '.metadata'}"


def _tamper_part(name: str) -> Any:
    def tamper(step: Path, marker: Path) -> str:
        (step / f"{name}.pt").write_bytes(_pickled({"position": WritesAFile(marker)}))
        return f"checkpoint file {step / f'{name}.pt'}"

    return tamper


def _save_tamper_resume(rank: int, world: int, root: Path, how: str, fmt: str) -> dict[str, Any]:
    """Rank 0 of 1: a run saves step-2, the checkpoint is tampered with (``how``), a run resumes."""
    trainer_class = _trainer_class()
    trainer = trainer_class(TrainConfig(**{**TINY, "steps": 2}, save=str(root / "run"), checkpoint_format=fmt))
    try:
        trainer.train()
    finally:
        trainer.close()
    step, marker = root / "run" / "step-2", root / "ran"
    entry = TAMPERS[how](step, marker)
    _redo_digests(step)
    try:
        resumed = trainer_class(TrainConfig(**TINY, save=str(root / "resumed"), resume=str(step)))
    except CheckpointError as err:
        return {"error": str(err), "entry": entry, "ran": marker.exists()}
    resumed.close()
    return {"error": None, "entry": entry, "ran": marker.exists()}


def _trainer_class() -> type:
    if os.environ.get("HP_PLATFORM") == "mindspore":
        from hyperpar_gdn.train.backends.mindspore_backend import MindSporeTrainer

        return MindSporeTrainer
    return Trainer


TAMPERS = {
    "dcp_entry": _tamper_dcp_entry,
    "dcp_index": _tamper_dcp_index,
    "data_part": _tamper_part("data"),
    "optimizer_part": _tamper_part("optimizer"),
    "train_part": _tamper_part("train"),
}


def _assert_refused(outcome: dict[str, Any]) -> None:
    error = outcome["error"]
    print(f"refused: {error}; the file written: {outcome['ran']}")
    assert error is not None, "the tampered checkpoint was loaded"
    assert not outcome["ran"], "the checkpoint's code ran"
    assert "\n" not in error and error.startswith(outcome["entry"]), error
    assert "was refused unread: it names" in error and "(a checkpoint is read as data)" in error, error


@pytest.mark.parametrize(
    ("how", "fmt"),
    [
        ("dcp_entry", "sharded"),
        ("dcp_index", "sharded"),
        ("data_part", "sharded"),
        ("optimizer_part", "whole"),
    ],
)
def test_torch_refuses_a_tampered_checkpoint_without_running_it(tmp_path: Path, how: str, fmt: str) -> None:
    (outcome,) = run_ranks(_save_tamper_resume, 1, tmp_path, how, fmt, timeout_s=240)
    _assert_refused(outcome)


@pytest.mark.parametrize(("how", "fmt"), [("train_part", "sharded"), ("optimizer_part", "whole")])
def test_mindspore_refuses_a_tampered_checkpoint_without_running_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str, fmt: str
) -> None:
    pytest.importorskip("mindspore")
    monkeypatch.setenv("HP_PLATFORM", "mindspore")
    _assert_refused(_save_tamper_resume(0, 1, tmp_path, how, fmt))


def test_the_tampered_entry_runs_its_code_under_dcps_default_reader(tmp_path: Path) -> None:
    """The check above can fail: DCP's own reader, given the same entry, writes the file."""
    import torch.distributed.checkpoint as dcp

    state = {
        "model": {"w": torch.ones(2)},
        "optimizer": {"param_groups": [{"lr": WritesAFile(tmp_path / "ran")}]},
    }
    write_shards(state, tmp_path / STATE_DIR)
    target: dict[str, Any] = {"model": {"w": torch.empty(2)}, "optimizer": {"param_groups": [{"lr": None}]}}
    dcp.load(target, storage_reader=dcp.FileSystemReader(str(tmp_path / STATE_DIR)), no_dist=True)
    assert (tmp_path / "ran").read_text() == "ran"
    (tmp_path / "ran").unlink()
    with pytest.raises(CheckpointError, match="checkpoint entry optimizer.param_groups.0.lr in .* refused"):
        load_whole(tmp_path / STATE_DIR)
    assert not (tmp_path / "ran").exists()
