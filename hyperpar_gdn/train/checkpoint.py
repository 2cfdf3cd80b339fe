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

This module writes the whole format (format 1: every part gathered and written by one rank). The
sharded format (format 2, :mod:`.sharded_checkpoint`: each rank writes its own shard of the model
and optimizer state) shares the directory names, the manifest and the commit by rename; its
manifest also lists every shard file with its size and sha256 (``"shards"``) and says how
``state/`` is laid out (``"layout"``: torch's DCP files, or the per-rank parts of a replicated
state that MindSpore writes, :mod:`.replicated_shards`). Both formats are read here:
:func:`load_checkpoint` loads a sharded checkpoint whole on one host (``whole_state=True``, for
converters and tests) or only its small parts (a resuming run then loads its shards itself).
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
FORMAT = 1  # the whole format; what save_checkpoint writes
SHARDED_FORMAT = 2  # the sharded format (.sharded_checkpoint)
FORMATS = (FORMAT, SHARDED_FORMAT)
# How a sharded checkpoint's state/ is laid out (its manifest's "layout"; "dcp" when absent):
# torch's DCP files (.sharded_checkpoint), or the parts of a replicated state (.replicated_shards)
DCP_LAYOUT = "dcp"
REPLICATED_LAYOUT = "replicated"
SHARD_LAYOUTS = (DCP_LAYOUT, REPLICATED_LAYOUT)
_CHUNK = 1 << 20  # bytes read at a time for a checksum
_STEP_DIR = re.compile(r"^step-(\d+)$")
_INCOMPLETE = re.compile(r"^\.step-\d+\.(tmp|old)-\d+$")  # a save in progress, or one that died

__all__ = [
    "DCP_LAYOUT",
    "REPLICATED_LAYOUT",
    "SHARD_LAYOUTS",
    "CheckpointError",
    "check_digest",
    "file_digest",
    "install",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "nonfinite_entries",
    "os_error_behind",
    "prune_checkpoints",
    "read_manifest",
    "remove_incomplete",
    "resolve_checkpoint",
    "save_checkpoint",
    "serialize_parts",
    "shard_layout",
    "write_atomic",
    "write_manifest",
    "write_parts",
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
    blobs = serialize_parts(parts)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    temp = root / f".step-{step}.tmp-{os.getpid()}"
    shutil.rmtree(temp, ignore_errors=True)  # a leftover of this very pid (a save that raised)
    try:
        temp.mkdir()
        manifest = write_parts(temp, blobs, {"format": FORMAT, "step": step, "meta": meta})
        write_manifest(temp, manifest)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return install(temp, root / f"step-{step}")


def serialize_parts(parts: dict[str, Any]) -> dict[str, bytes]:
    """``torch.save`` of each part (name -> state) into bytes; the names must be identifiers."""
    if not parts or any(not re.fullmatch(r"[A-Za-z0-9_]+", name) for name in parts):
        raise ValueError(f"part names must be non-empty identifiers; got {sorted(parts)}")
    blobs = {}
    for name, state in parts.items():
        buffer = io.BytesIO()
        torch.save(state, buffer)
        blobs[name] = buffer.getvalue()
    return blobs


def write_parts(directory: Path, blobs: dict[str, bytes], manifest: dict[str, Any]) -> dict[str, Any]:
    """Write each serialized part to ``directory/<name>.pt`` (flushed); returns ``manifest`` with
    their ``"parts"`` entries (file, size, sha256) added."""
    entries = {}
    for name, data in blobs.items():
        file = f"{name}.pt"
        _write_flushed(directory / file, data)
        entries[name] = {"file": file, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    return {**manifest, "parts": entries}


def install(temp: Path, directory: Path) -> Path:
    """Commit a fully written ``temp`` directory as ``directory`` by a rename (an existing one is
    moved aside first and deleted after); ``temp`` is removed if that fails."""
    root = directory.parent
    try:
        _fsync_directory(temp)
        if directory.exists():  # replace: move the old one aside, then the new one in
            old = root / f".{directory.name}.old-{os.getpid()}"
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


def file_digest(path: Path) -> tuple[int, str]:
    """(size in bytes, sha256 hex) of the file at ``path``, read in chunks (bounded memory)."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def os_error_behind(err: BaseException) -> OSError | None:
    """``err`` itself or the first ``OSError`` in its chain of causes and contexts (torch's
    serializer reports a failed write as a ``RuntimeError`` whose context is the ``OSError``)."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


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
    root: str | Path,
    *,
    warn: Callable[[str], None],
    whole_state: bool = True,
    skip: frozenset[int] = frozenset(),
) -> tuple[Path, int, dict[str, Any], dict[str, Any]] | None:
    """The newest checkpoint under ``root`` that passes every check, loaded:
    ``(directory, step, parts, meta)``; ``None`` when ``root`` holds none.

    A newer one that fails its checks (a missing manifest or part, a wrong size or sha256, an
    unreadable file) is skipped; ``warn`` gets one line naming the file and the fallback. Steps in
    ``skip`` (found damaged by a check made elsewhere) are passed over silently.
    ``whole_state``: as :func:`load_checkpoint`.
    """
    for step, directory in reversed(list_checkpoints(root)):
        if step in skip:
            continue
        try:
            loaded_step, parts, meta = load_checkpoint(directory, whole_state=whole_state)
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


def load_checkpoint(
    path: str | Path, *, whole_state: bool = True
) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """Read ``path`` (see :func:`resolve_checkpoint`) -> (step, parts by name, meta).

    Tensors are loaded to the CPU. Raises :class:`CheckpointError` for a missing directory,
    manifest or part, and for a part whose size, checksum or contents are wrong. A sharded
    checkpoint (format 2): ``whole_state`` loads its ``model`` and ``optimizer`` whole on this
    host after checking every shard's checksum; False returns its small parts only, after
    checking that every shard file is there with its size (:func:`~.sharded_checkpoint.verify_shards` checks their
    checksums, spread over the ranks).
    """
    directory = resolve_checkpoint(path)
    manifest = read_manifest(directory)
    parts = {}
    for name, entry in manifest["parts"].items():
        data = _checked_bytes(directory / entry["file"], entry, directory / MANIFEST)
        try:
            parts[name] = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as err:
            raise CheckpointError(
                f"checkpoint file {directory / entry['file']} could not be read: {err}"
            ) from err
    if manifest["format"] == SHARDED_FORMAT:
        from hyperpar_gdn.train.sharded_checkpoint import check_and_load_shards

        parts.update(check_and_load_shards(directory, manifest, whole_state=whole_state))
    return int(manifest["step"]), parts, manifest["meta"]


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest of step directory ``directory``, checked for its keys and format."""
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(
            f"{manifest_path} is missing: {directory} is not a complete checkpoint (an interrupted save?)"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
        int(manifest["step"]), dict(manifest["parts"]), manifest["meta"]
        if manifest.get("format") == SHARDED_FORMAT:
            dict(manifest["shards"])
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{manifest_path} is corrupt: {type(err).__name__}: {err}") from err
    if manifest.get("format") not in FORMATS:
        raise CheckpointError(
            f"{manifest_path} has format {manifest.get('format')!r}; this code reads "
            f"{' and '.join(map(str, FORMATS))}"
        )
    if manifest["format"] == SHARDED_FORMAT and shard_layout(manifest) not in SHARD_LAYOUTS:
        raise CheckpointError(
            f"{manifest_path} has shard layout {manifest['layout']!r}; this code reads "
            f"{' and '.join(SHARD_LAYOUTS)}"
        )
    return manifest


def shard_layout(manifest: dict[str, Any]) -> str:
    """The layout of a sharded checkpoint's ``state/`` (:data:`SHARD_LAYOUTS`) from its manifest;
    checkpoints written before the layout was recorded are DCP's."""
    return manifest.get("layout", DCP_LAYOUT)


def _checked_bytes(file: Path, entry: dict[str, Any], manifest_path: Path) -> bytes:
    if not file.is_file():
        raise CheckpointError(f"checkpoint file {file} is missing (listed in {manifest_path})")
    data = file.read_bytes()
    check_digest(file, entry, (len(data), hashlib.sha256(data).hexdigest()), file.parent)
    return data


def check_digest(file: Path, entry: dict[str, Any], found: tuple[int, str] | None, directory: Path) -> None:
    """Raise naming ``file`` when it is missing (``found`` None) or its (size, sha256) differ."""
    if found is None:
        raise CheckpointError(f"checkpoint file {file} is missing (listed in {directory / MANIFEST})")
    size, digest = found
    if size != entry["bytes"] or digest != entry["sha256"]:
        raise CheckpointError(
            f"checkpoint file {file} is corrupt: {size} bytes with sha256 {digest[:16]}..., "
            f"the manifest says {entry['bytes']} bytes with sha256 {entry['sha256'][:16]}..."
        )


def _manifest_bytes(manifest: dict[str, Any]) -> bytes:
    return (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()


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


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    """Write ``manifest`` to ``directory/manifest.json``, flushed to disk."""
    _write_flushed(directory / MANIFEST, _manifest_bytes(manifest))


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
