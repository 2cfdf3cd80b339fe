"""A checkpoint's directory on disk, for both formats and every framework (no torch here).

Layout of ``<root>/step-N/``: the parts' files and ``manifest.json`` (the format, the step, the
run's options and, per file, its size and sha256; see :mod:`.whole` and
:mod:`.sharded` for what each format puts there).

A save is complete or invisible: everything is written and flushed (:func:`write_flushed`) into a
temporary directory beside the target (``.step-N.tmp-<pid>``), which :func:`install` then renames
to ``step-N`` (``os.rename``, atomic on POSIX); a writer that dies before the rename leaves only
the hidden directory, which :func:`list_checkpoints` never lists and :func:`remove_incomplete`
deletes. Reading checks the manifest (:func:`read_manifest`) and each file's size and sha256
(:func:`check_digest`) before anything is deserialized, raising :class:`CheckpointError` naming
the path.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from hyperpar_gdn.train.errors import CheckpointError

__all__ = [
    "DCP_LAYOUT",
    "FORMAT",
    "FORMATS",
    "MANIFEST",
    "REPLICATED_LAYOUT",
    "SHARDED_FORMAT",
    "SHARD_LAYOUTS",
    "check_digest",
    "checked_bytes",
    "file_digest",
    "fsync_path",
    "install",
    "list_checkpoints",
    "os_error_behind",
    "prune_checkpoints",
    "read_manifest",
    "remove_incomplete",
    "resolve_checkpoint",
    "shard_layout",
    "write_atomic",
    "write_flushed",
    "write_manifest",
    "write_parts",
]

MANIFEST = "manifest.json"
FORMAT = 1  # the whole format (.whole): every part gathered and written by one rank
SHARDED_FORMAT = 2  # the sharded format (.sharded): every rank writes its shard
FORMATS = (FORMAT, SHARDED_FORMAT)
# How a sharded checkpoint's state/ is laid out (its manifest's "layout"; "dcp" when absent):
# torch's DCP files (.sharded), or the parts of a replicated state (.replicated_shards)
DCP_LAYOUT = "dcp"
REPLICATED_LAYOUT = "replicated"
SHARD_LAYOUTS = (DCP_LAYOUT, REPLICATED_LAYOUT)
_CHUNK = 1 << 20  # bytes read at a time for a checksum
_STEP_DIR = re.compile(r"^step-(\d+)$")
# a save in progress or one that died, an old copy a re-save moved aside, a deletion cut short
_INCOMPLETE = re.compile(r"^\.step-(\d+)\.(tmp|old|del)-\d+$")


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename."""
    _commit([_write_temp(Path(path), data)])


def write_parts(directory: Path, blobs: dict[str, bytes], manifest: dict[str, Any]) -> dict[str, Any]:
    """Write each serialized part to ``directory/<name>.pt`` (flushed); returns ``manifest`` with
    their ``"parts"`` entries (file, size, sha256) added."""
    entries = {}
    for name, data in blobs.items():
        file = f"{name}.pt"
        write_flushed(directory / file, data)
        entries[name] = {"file": file, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    return {**manifest, "parts": entries}


def install(temp: Path, directory: Path) -> Path:
    """Commit a fully written ``temp`` directory as ``directory`` by a rename; ``temp`` is removed
    if that fails.

    An existing ``directory`` (a re-save of the same step) is first renamed aside to
    ``.step-N.old-<pid>`` and deleted once the new one is in place. A process killed between the
    two renames leaves no ``step-N`` but that complete old copy, which :func:`remove_incomplete`
    renames back: at every point of a save the newest complete checkpoint is there."""
    root = directory.parent
    old = root / f".{directory.name}.old-{os.getpid()}"
    try:
        fsync_path(temp)
        if directory.exists():  # replace: move the old one aside, then the new one in
            shutil.rmtree(old, ignore_errors=True)
            os.rename(directory, old)
            fsync_path(root)
            os.rename(temp, directory)
            fsync_path(root)
            _delete(old)
        else:
            os.rename(temp, directory)
        fsync_path(root)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        if old.exists() and not directory.exists():  # the new one never came in: the old one back
            os.rename(old, directory)
        raise
    return directory


def _delete(directory: Path) -> None:
    """Remove ``directory``: first renamed to a hidden ``.step-N.del-<pid>`` (one atomic step, so
    a process killed while deleting leaves no half ``step-N``), then deleted."""
    step = re.search(r"step-(\d+)", directory.name)
    assert step is not None, directory
    doomed = directory.with_name(f".step-{step.group(1)}.del-{os.getpid()}")
    shutil.rmtree(doomed, ignore_errors=True)
    os.rename(directory, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


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


def prune_checkpoints(root: str | Path, keep_last: int, *, up_to: int) -> list[Path]:
    """Of the ``step-N`` directories with ``N <= up_to`` (the step just saved), delete all but the
    newest ``keep_last`` (>= 1); returns those deleted. Newer ones (an earlier run's, kept by a
    run that started over) are left alone."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1; got {keep_last}")
    mine = [directory for step, directory in list_checkpoints(root) if step <= up_to]
    doomed = mine[:-keep_last]
    for directory in doomed:
        _delete(directory)
    return doomed


def remove_incomplete(root: str | Path) -> list[Path]:
    """Tidy what saves that died left under ``root``; returns the directories deleted. Call it
    only when no save into ``root`` is in progress.

    A ``.step-N.old-*`` with no ``step-N`` beside it is the complete checkpoint a re-save had
    moved aside when it died (:func:`install`): it is renamed back to ``step-N``. Every other
    hidden leftover (``.step-N.tmp-*``: a save that did not finish; ``.old-*`` whose ``step-N``
    is back; ``.del-*``: a deletion cut short) is deleted."""
    root = Path(root)
    if not root.is_dir():
        return []
    leftovers = sorted(child for child in root.iterdir() if child.is_dir() and _INCOMPLETE.match(child.name))
    removed = []
    for directory in leftovers:
        match = _INCOMPLETE.match(directory.name)
        assert match is not None
        step_dir = root / f"step-{match.group(1)}"
        if match.group(2) == "old" and not step_dir.exists():
            os.rename(directory, step_dir)
            fsync_path(root)
            continue
        shutil.rmtree(directory, ignore_errors=True)
        removed.append(directory)
    return removed


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


def checked_bytes(file: Path, entry: dict[str, Any], manifest_path: Path) -> bytes:
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


def write_flushed(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and flush it to disk (a failed write raises its ``OSError``)."""
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def fsync_path(path: Path) -> None:
    """Flush ``path`` to disk: a file's data, or a directory's entries (new names, renames)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    """Write ``manifest`` to ``directory/manifest.json``, flushed to disk."""
    write_flushed(directory / MANIFEST, _manifest_bytes(manifest))


def _write_temp(path: Path, data: bytes) -> tuple[Path, Path]:
    """Write ``data`` to a temporary file beside ``path``, flushed to disk; return (temp, path)."""
    temp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write_flushed(temp, data)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    return temp, path


def _commit(temps: list[tuple[Path, Path]]) -> None:
    for temp, path in temps:
        os.replace(temp, path)
