"""Checkpoints: named stateful parts under ``<root>/step-N/``, written atomically.

Layout of ``step-N/``: one file per part (``model.pt``, ``optimizer.pt``, ``data.pt``,
``train.pt``: whatever the caller names) and ``manifest.json`` (the step, the run's options and,
per part, its file, size and sha256).

A save never damages what is on disk: every part is first serialized in memory and written to a
temporary file beside its target; only when all of them are written and flushed are they renamed
over the targets (``os.replace``, atomic on POSIX), the manifest last. A failure before that
leaves every original file as it was (the temporary files are removed). A crash in the middle of
the renames leaves files that disagree with the manifest, which loading reports as corrupt.

Loading checks the manifest and every part's size and checksum before deserializing, and raises
:class:`CheckpointError` naming the offending path.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from pathlib import Path
from typing import Any

import torch

MANIFEST = "manifest.json"
FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d+)$")

__all__ = ["CheckpointError", "load_checkpoint", "resolve_checkpoint", "save_checkpoint", "write_atomic"]


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt; the message names the path."""


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename."""
    _commit([_write_temp(Path(path), data)])


def save_checkpoint(root: str | Path, step: int, parts: dict[str, Any], *, meta: dict[str, Any]) -> Path:
    """Write ``parts`` (name -> state, anything ``torch.save`` takes) to ``root/step-<step>/``.

    ``meta`` (JSON-serializable: the run's options) goes into the manifest. Returns the step
    directory. Overwrites an existing checkpoint of the same step only once every new file is on
    disk.
    """
    if not parts or any(not re.fullmatch(r"[A-Za-z0-9_]+", name) for name in parts):
        raise ValueError(f"part names must be non-empty identifiers; got {sorted(parts)}")
    directory = Path(root) / f"step-{step}"
    directory.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, Any] = {"format": FORMAT, "step": step, "meta": meta, "parts": {}}
    blobs: dict[Path, bytes] = {}
    for name, state in parts.items():
        buffer = io.BytesIO()
        torch.save(state, buffer)
        data = buffer.getvalue()
        file = f"{name}.pt"
        manifest["parts"][name] = {
            "file": file,
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
        blobs[directory / file] = data
    blobs[directory / MANIFEST] = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
    temps: list[tuple[Path, Path]] = []
    try:
        for path, data in blobs.items():
            temps.append(_write_temp(path, data))
    except BaseException:
        for temp, _ in temps:
            temp.unlink(missing_ok=True)
        raise
    _commit(temps)  # the manifest is the last entry: it is replaced last
    return directory


def resolve_checkpoint(path: str | Path) -> Path:
    """``path`` itself when it is a ``step-N`` directory (or holds a manifest), else the
    ``step-N`` under it with the largest N."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} is not a directory (expected <root> or <root>/step-N)")
    if _STEP_DIR.match(path.name) or (path / MANIFEST).exists():
        return path
    steps = sorted(
        (int(m.group(1)), child)
        for child in path.iterdir()
        if child.is_dir() and (m := _STEP_DIR.match(child.name))
    )
    if not steps:
        raise CheckpointError(f"{path} holds no step-N checkpoint directory")
    return steps[-1][1]


def load_checkpoint(path: str | Path) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """Read ``path`` (see :func:`resolve_checkpoint`) -> (step, parts by name, meta).

    Tensors are loaded to the CPU. Raises :class:`CheckpointError` for a missing directory,
    manifest or part, and for a part whose size, checksum or contents are wrong.
    """
    directory = resolve_checkpoint(path)
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(
            f"{manifest_path} is missing: {directory} is not a complete checkpoint (an interrupted save?)"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
        step, entries, meta = int(manifest["step"]), dict(manifest["parts"]), manifest["meta"]
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{manifest_path} is corrupt: {type(err).__name__}: {err}") from err
    if manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"{manifest_path} has format {manifest.get('format')!r}; this code reads {FORMAT}"
        )
    parts = {}
    for name, entry in entries.items():
        file = directory / entry["file"]
        if not file.is_file():
            raise CheckpointError(f"checkpoint file {file} is missing (listed in {manifest_path})")
        data = file.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        if len(data) != entry["bytes"] or digest != entry["sha256"]:
            raise CheckpointError(
                f"checkpoint file {file} is corrupt: {len(data)} bytes with sha256 {digest[:16]}..., "
                f"the manifest says {entry['bytes']} bytes with sha256 {entry['sha256'][:16]}..."
            )
        try:
            parts[name] = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as err:
            raise CheckpointError(f"checkpoint file {file} could not be read: {err}") from err
    return step, parts, meta


def _write_temp(path: Path, data: bytes) -> tuple[Path, Path]:
    """Write ``data`` to a temporary file beside ``path``, flushed to disk; return (temp, path)."""
    temp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(temp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    return temp, path


def _commit(temps: list[tuple[Path, Path]]) -> None:
    for temp, path in temps:
        os.replace(temp, path)
