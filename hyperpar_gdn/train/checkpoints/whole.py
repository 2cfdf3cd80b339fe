"""Checkpoints in the whole format, and the loading of either format: named stateful parts under
``<root>/step-N/``, complete or invisible.

Layout of ``step-N/`` (format 1): one file per part (``model.pt``, ``optimizer.pt``, ``data.pt``,
``train.pt``: whatever the caller names), each a ``torch.save``, and ``manifest.json`` (the step,
the run's options and, per part, its file, size and sha256). Writing is :mod:`.directory`'s:
every file is flushed into a hidden temporary directory, which a rename makes ``step-N`` once
all of it is on disk; replacing an existing ``step-N`` moves the old one aside first, so the
newest ``step-N`` on disk is always whole, and a failure before the rename leaves every existing
checkpoint as it was.

Loading checks the manifest and every part's size and checksum before deserializing, and raises
:class:`CheckpointError` naming the offending path; :func:`latest_checkpoint` skips such a
checkpoint with a warning naming the file and takes the one before it.

The sharded format (format 2, :mod:`.sharded`: each rank writes its own shard of the
model and optimizer state) shares the directory names, the manifest and the commit by rename; its
manifest also lists every shard file with its size and sha256 (``"shards"``) and says how
``state/`` is laid out (``"layout"``: torch's DCP files, or the per-rank parts of a replicated
state that MindSpore writes, :mod:`.replicated_shards`). :func:`load_checkpoint` reads both: a
sharded checkpoint whole on one host (``whole_state=True``, for converters and tests) or only its
small parts (a resuming run then loads its shards itself).
"""

from __future__ import annotations

import io
import os
import pickle
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from hyperpar_gdn.train.checkpoints.directory import (
    FORMAT,
    MANIFEST,
    SHARDED_FORMAT,
    checked_bytes,
    install,
    list_checkpoints,
    read_manifest,
    resolve_checkpoint,
    write_manifest,
    write_parts,
)
from hyperpar_gdn.train.checkpoints.dcp_data import refusal
from hyperpar_gdn.train.errors import CheckpointError

__all__ = [
    "latest_checkpoint",
    "load_checkpoint",
    "nonfinite_entries",
    "save_checkpoint",
    "serialize_parts",
]


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


def nonfinite_entries(state: Any, prefix: str = "") -> list[str]:
    """The dotted names of the floating-point tensors in ``state`` (nested dicts and lists) that
    hold a NaN or an inf; what a checkpoint must never hold. A DTensor is checked for this rank's
    piece only (no collective)."""
    if isinstance(state, DTensor):
        state = state.to_local()
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


def load_checkpoint(
    path: str | Path, *, whole_state: bool = True
) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """Read ``path`` (see :func:`resolve_checkpoint`) -> (step, parts by name, meta).

    Tensors are loaded to the CPU. Raises :class:`CheckpointError` for a missing directory,
    manifest or part, and for a part whose size, checksum or contents are wrong. A sharded
    checkpoint (format 2): ``whole_state`` loads its ``model`` and ``optimizer`` whole on this
    host after checking every shard's checksum; False returns its small parts only, after
    checking that every shard file is there with its size (:func:`~.sharded.verify_shards` checks their
    checksums, spread over the ranks).
    """
    directory = resolve_checkpoint(path)
    manifest = read_manifest(directory)
    parts = {}
    for name, entry in manifest["parts"].items():
        data = checked_bytes(directory / entry["file"], entry, directory / MANIFEST)
        try:  # as data: a pickle naming anything but tensors and plain containers is refused
            parts[name] = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            raise CheckpointError(
                f"checkpoint file {directory / entry['file']} was refused unread: {refusal(err)} "
                "(a checkpoint is read as data)"
            ) from None
        except Exception as err:
            raise CheckpointError(
                f"checkpoint file {directory / entry['file']} could not be read: {err}"
            ) from err
    if manifest["format"] == SHARDED_FORMAT:
        from hyperpar_gdn.train.checkpoints.sharded import check_and_load_shards

        parts.update(check_and_load_shards(directory, manifest, whole_state=whole_state))
        if whole_state:  # loaded in the single-device row order (:mod:`.row_orders`)
            return int(manifest["step"]), parts, _without_row_orders(manifest["meta"])
    return int(manifest["step"]), parts, manifest["meta"]


def _without_row_orders(meta: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in meta.items() if key != "row_orders"}
