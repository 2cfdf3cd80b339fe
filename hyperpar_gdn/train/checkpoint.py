"""Checkpoints: named stateful parts under ``<root>/step-N/``, complete or invisible.

Layout of ``step-N/``: one file per part (``model.pt``, ``optimizer.pt``, ``data.pt``,
``train.pt``: whatever the caller names) and ``manifest.json`` (the step, the run's options and,
per part, its file, size and sha256).

A save is complete or invisible. Every part and the manifest are written and flushed into a
temporary directory beside the target (``.step-N.tmp-<pid>``); only then is that directory renamed
to ``step-N`` (``os.rename``, atomic on POSIX). A writer that dies before the rename leaves only
the hidden temporary directory, which :func:`latest_checkpoint` never picks and
:func:`remove_incomplete` deletes. Replacing an existing ``step-N`` moves the old one aside
first, so the newest ``step-N`` on disk is always whole. A failure before the rename leaves
every existing checkpoint as it was.

Loading checks the manifest and every part's size and checksum before deserializing, and raises
:class:`CheckpointError` naming the offending path; :func:`latest_checkpoint` skips such a
checkpoint with a warning naming the file and takes the one before it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

MANIFEST = "manifest.json"
FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d+)$")
_INCOMPLETE = re.compile(r"^\.step-\d+\.(tmp|old)-\d+$")  # a save in progress, or one that died

__all__ = [
    "CheckpointError",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "nonfinite_entries",
    "prune_checkpoints",
    "remove_incomplete",
    "resolve_checkpoint",
    "save_checkpoint",
    "write_atomic",
]


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt; the message names the path."""


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename."""
    _commit([_write_temp(Path(path), data)])


def save_checkpoint(root: str | Path, step: int, parts: dict[str, Any], *, meta: dict[str, Any]) -> Path:
    """Write ``parts`` (name -> state, anything ``torch.save`` takes) to ``root/step-<step>/``.

    ``meta`` (JSON-serializable: the run's options) goes into the manifest. Returns the step
    directory, which appears (by a rename) only once every part and the manifest are on disk. An
    existing checkpoint of the same step is replaced only then.
    """
    if not parts or any(not re.fullmatch(r"[A-Za-z0-9_]+", name) for name in parts):
        raise ValueError(f"part names must be non-empty identifiers; got {sorted(parts)}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    directory = root / f"step-{step}"
    manifest: dict[str, Any] = {"format": FORMAT, "step": step, "meta": meta, "parts": {}}
    blobs: dict[str, bytes] = {}
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
        blobs[file] = data
    blobs[MANIFEST] = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
    temp = root / f".step-{step}.tmp-{os.getpid()}"
    shutil.rmtree(temp, ignore_errors=True)  # a leftover of this very pid (a save that raised)
    try:
        temp.mkdir()
        for file, data in blobs.items():
            _write_flushed(temp / file, data)
        _fsync_directory(temp)
        if directory.exists():  # replace: move the old one aside, then the new one in
            old = root / f".step-{step}.old-{os.getpid()}"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(directory, old)
            os.rename(temp, directory)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(temp, directory)
        _fsync_directory(root)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return directory


def nonfinite_entries(state: Any, prefix: str = "") -> list[str]:
    """The dotted names of the floating-point tensors in ``state`` (nested dicts and lists) that
    hold a NaN or an inf; what a checkpoint must never hold."""
    if isinstance(state, torch.Tensor):
        finite = not state.is_floating_point() or bool(torch.isfinite(state).all())
        return [] if finite else [prefix]
    if isinstance(state, dict):
        items: Any = state.items()
    elif isinstance(state, (list, tuple)):
        items = enumerate(state)
    else:
        return []
    found = []
    for key, value in items:
        found += nonfinite_entries(value, f"{prefix}.{key}" if prefix else str(key))
    return found


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """``(step, directory)`` of every ``step-N`` directory under ``root``, oldest first (none
    when ``root`` does not exist). Says nothing about whether they are complete."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(
        (int(m.group(1)), child)
        for child in root.iterdir()
        if child.is_dir() and (m := _STEP_DIR.match(child.name))
    )


def latest_checkpoint(
    root: str | Path, *, warn: Callable[[str], None]
) -> tuple[Path, int, dict[str, Any], dict[str, Any]] | None:
    """The newest checkpoint under ``root`` that passes every check, loaded:
    ``(directory, step, parts, meta)``; ``None`` when ``root`` holds none.

    A newer one that fails its checks (a missing manifest or part, a wrong size or sha256, an
    unreadable file) is skipped; ``warn`` gets one line naming the file and the fallback.
    """
    for step, directory in reversed(list_checkpoints(root)):
        try:
            loaded_step, parts, meta = load_checkpoint(directory)
        except CheckpointError as err:
            warn(f"skipping checkpoint {directory}: {err}; trying the one before it")
            continue
        if loaded_step != step:
            warn(f"skipping checkpoint {directory}: its manifest says step {loaded_step}")
            continue
        return directory, step, parts, meta
    return None


def prune_checkpoints(root: str | Path, keep_last: int, *, up_to: int) -> list[Path]:
    """Of the ``step-N`` directories with ``N <= up_to`` (the step just saved), delete all but the
    newest ``keep_last`` (>= 1); returns those deleted. Newer ones (an earlier run's, kept by a
    run that started over) are left alone."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1; got {keep_last}")
    mine = [directory for step, directory in list_checkpoints(root) if step <= up_to]
    doomed = mine[:-keep_last]
    for directory in doomed:
        shutil.rmtree(directory)
    return doomed


def remove_incomplete(root: str | Path) -> list[Path]:
    """Delete what saves that died left under ``root`` (hidden ``.step-N.tmp-*`` / ``.old-*``
    directories); returns them. Call it only when no save into ``root`` is in progress."""
    root = Path(root)
    if not root.is_dir():
        return []
    leftovers = sorted(child for child in root.iterdir() if child.is_dir() and _INCOMPLETE.match(child.name))
    for directory in leftovers:
        shutil.rmtree(directory, ignore_errors=True)
    return leftovers


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
    steps = list_checkpoints(path)
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


def _write_flushed(path: Path, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_directory(path: Path) -> None:
    """Make the entries of directory ``path`` (new names, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_temp(path: Path, data: bytes) -> tuple[Path, Path]:
    """Write ``data`` to a temporary file beside ``path``, flushed to disk; return (temp, path)."""
    temp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        _write_flushed(temp, data)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    return temp, path


def _commit(temps: list[tuple[Path, Path]]) -> None:
    for temp, path in temps:
        os.replace(temp, path)
