"""Sharded checkpoints (format 2): every rank writes its own shard of the model and optimizer
state, with torch's distributed checkpoint (DCP).

Layout of ``step-N/``::

    manifest.json         format 2, the step, the run's options, and the size and sha256 of
                          every file below ("parts": the small whole parts, "shards": state/)
    data.pt, train.pt     the sampler's position and the RNG state (small, written by rank 0)
    state/.metadata       DCP's index: which file holds which piece of which tensor
    state/__<r>_0.distcp  what rank r wrote

That is the ``"dcp"`` layout of ``state/`` (torch). MindSpore writes the ``"replicated"`` one
(:mod:`.replicated_shards`: each rank a disjoint part of its replicated state, ``state/index.json``
and ``state/rank-<r>.safetensors``); the manifest's ``"layout"`` says which, and everything below
but DCP's own reading and writing serves both.

The state is ``{"model": ..., "optimizer": ...}`` as ``get_state_dict`` gives it, keyed by
parameter names: under ``--fsdp`` each parameter and its AdamW moments are DTensors and each rank
writes its own rows; without FSDP the tensors are replicated and DCP writes each once, spread over
the ranks. No rank gathers the whole state. Loading asks each rank's current layout for its
pieces and DCP reads them from whichever files hold them, so a checkpoint resumes at any CP, DP or
TP size, with or without ``--fsdp`` (:func:`load_shards`; under ``--tp`` the fused projections'
rows are in the order of :mod:`.row_orders`, which the manifest names); :func:`load_whole` reads
it whole on one host (the converter, tests).

The commit is that of the whole format: every rank writes into the hidden ``.step-N.tmp-<pid>``
directory (rank 0's pid), DCP's last step is a barrier after rank 0 wrote ``.metadata``, then rank
0 checksums every file, writes the manifest and renames the directory to ``step-N``
(:func:`commit_sharded`; in the replicated layout the barrier is the reduction that settles the
save, after every rank wrote its part). A save that dies before the rename leaves only the
hidden directory.
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import TensorStorageMetadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from hyperpar_gdn.train.checkpoints.directory import (
    DCP_LAYOUT,
    MANIFEST,
    REPLICATED_LAYOUT,
    SHARDED_FORMAT,
    check_digest,
    file_digest,
    install,
    os_error_behind,
    read_manifest,
    shard_layout,
    write_manifest,
    write_parts,
)
from hyperpar_gdn.train.checkpoints.dcp_data import DataLoadPlanner, DataReader, first_checkpoint_error
from hyperpar_gdn.train.errors import CheckpointError
from hyperpar_gdn.train.checkpoints.replicated_shards import INDEX as REPLICATED_INDEX
from hyperpar_gdn.train.checkpoints.replicated_shards import load_replicated
from hyperpar_gdn.train.checkpoints.row_orders import MOMENTS, changed_names, move_rows, reorder_state

__all__ = [
    "STATE_DIR",
    "check_and_load_shards",
    "commit_sharded",
    "load_shards",
    "load_whole",
    "load_whole_state",
    "shard_entries",
    "sharded_state",
    "verify_shards",
    "write_shards",
]

STATE_DIR = "state"


def sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"model", "optimizer"}`` state dicts keyed by parameter names, each rank's own pieces
    (DTensors under FSDP2, the replicated tensors without): no gathering, no copy."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def write_shards(
    state: dict[str, Any], directory: Path, *, group: Any = None, background: bool = False
) -> Future | None:
    """Collective: every rank writes its pieces of ``state`` under ``directory`` (DCP). With
    ``background``, the pieces are first copied to host memory, then written by a thread
    (``dcp.async_save`` over ``group``, a process group for saving alone); returns its future,
    done once every rank's files and ``.metadata`` are written."""
    writer = _Writer(str(directory), sync_files=True)
    if background:
        return dcp.async_save(state, storage_writer=writer, process_group=group)
    dcp.save(state, storage_writer=writer)
    return None


def load_shards(
    directory: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    saved_orders: dict[str, Any] | None = None,
    orders: dict[str, Any] | None = None,
) -> None:
    """Collective: load the state under ``directory`` into ``model`` and ``optimizer`` in their
    current layout (any CP/DP/TP size, FSDP or not): each rank reads the pieces it holds.

    ``saved_orders``, ``orders``: the row orders (:mod:`.row_orders`) of the checkpoint and of
    ``model``. A tensor whose order differs (saved with ``--tp``, loaded without, or back) is read
    whole on every rank, its rows moved, and this rank's piece of it kept."""
    saved_orders, orders = saved_orders or {}, orders or {}
    state = sharded_state(model, optimizer)  # initializes AdamW's state: DCP loads in place
    moved = []  # (dict holding it, key, the state's own tensor, name)
    for name in changed_names(saved_orders, orders):
        holders = [state["model"], state["optimizer"].get("state", {}).get(name, {})]
        for holder in holders:
            for key in (name,) if holder is state["model"] else MOMENTS:
                if key in holder:
                    target = holder[key]
                    moved.append((holder, key, target, name))
                    holder[key] = torch.empty(target.shape, dtype=target.dtype)  # whole, on the host
    _load_as_data(state, directory)
    with torch.no_grad():
        for holder, key, target, name in moved:
            whole = move_rows(holder[key], saved_orders.get(name), orders.get(name))
            _copy_piece(target, whole)
            holder[key] = target
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def _copy_piece(target: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy into ``target`` (a DTensor: its local piece) its rows of ``whole``."""
    if not isinstance(target, DTensor):
        target.copy_(whole)
        return
    (chunk,) = target.__create_chunk_list__()  # where this rank's piece sits (what DCP reads by)
    piece = whole
    for dim, (offset, size) in enumerate(zip(chunk.offsets, chunk.sizes, strict=True)):
        piece = piece.narrow(dim, offset, size)
    target.to_local().copy_(piece)


def load_whole(directory: Path) -> dict[str, Any]:
    """The state under ``directory`` whole, in this process alone (no process group needed):
    ``{"model": {name: tensor}, "optimizer": {"state": ..., "param_groups": ...}}``."""
    reader = DataReader(str(directory))
    metadata = reader.read_metadata()
    # every entry DCP holds, by its flat key: an empty tensor of its size and dtype that DCP fills
    # in place, or a placeholder that DCP replaces by the value it reads (as data)
    flat: dict[str, Any] = {
        key: torch.empty(item.size, dtype=item.properties.dtype)
        if isinstance(item, TensorStorageMetadata)
        else None
        for key, item in metadata.state_dict_metadata.items()
    }
    with warnings.catch_warnings():  # no_dist: DCP warns that it assumes a single process, as asked
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        _load_as_data(flat, directory, reader=reader, no_dist=True, flatten=False)
    paths = metadata.planner_data or {}  # flat key -> its path in the saved nesting
    state: dict[str, Any] = {}
    for key, value in flat.items():
        _place(state, paths.get(key, (key,)), value)
    return state


def _load_as_data(
    state: dict[str, Any],
    directory: Path,
    *,
    reader: DataReader | None = None,
    no_dist: bool = False,
    flatten: bool = True,
) -> None:
    """``dcp.load`` of ``state`` from ``directory`` with nothing unpickled but data
    (:mod:`.dcp_data`); a refused entry is its one line, the same on every rank."""
    planner = DataLoadPlanner(directory, flatten_state_dict=flatten, flatten_sharded_tensors=flatten)
    if reader is None:
        reader = DataReader(str(directory))
        reader.read_metadata()  # every rank, before DCP (which would fold a refusal into its own text)
    try:
        dcp.load(state, storage_reader=reader, planner=planner, no_dist=no_dist)
    except (Exception, CheckpointException) as err:  # DCP's is a BaseException
        if (refused := first_checkpoint_error(err)) is not None:
            raise CheckpointError(str(refused)) from None
        raise


def _place(state: dict[str, Any], path: tuple[str | int, ...], value: Any) -> None:
    """Put ``value`` at ``path`` (dict keys and list indices) in ``state``, making the dicts and
    lists on the way."""
    node: Any = state
    for key, after in zip(path[:-1], path[1:], strict=True):
        if isinstance(node, list):
            node.extend([None] * (int(key) + 1 - len(node)))
            if node[key] is None:
                node[key] = [] if isinstance(after, int) else {}
        else:
            node.setdefault(key, [] if isinstance(after, int) else {})
        node = node[key]
    if isinstance(node, list):
        node.extend([None] * (int(path[-1]) + 1 - len(node)))
    node[path[-1]] = value


def load_whole_state(directory: Path, layout: str) -> dict[str, Any]:
    """The state under ``directory`` (a ``state/``) whole, in this process alone, as torch tensors:
    DCP's layout through :func:`load_whole`, the replicated one through
    :func:`~.replicated_shards.load_replicated` (every rank's part)."""
    if layout == REPLICATED_LAYOUT:
        return _as_torch(load_replicated(directory))
    return load_whole(directory)


_INDEX_FILES = {DCP_LAYOUT: ".metadata", REPLICATED_LAYOUT: REPLICATED_INDEX}  # rank 0 writes it


def _as_torch(node: Any) -> Any:
    if isinstance(node, np.ndarray):
        return torch.from_numpy(node)
    if isinstance(node, dict):
        return {key: _as_torch(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_as_torch(value) for value in node]
    return node


def commit_sharded(
    temp: Path,
    directory: Path,
    *,
    step: int,
    meta: dict[str, Any],
    blobs: dict[str, bytes],
    layout: str = DCP_LAYOUT,
) -> Path:
    """Rank 0, once every rank's shard is under ``temp/state`` in ``layout``: write the small parts
    (``blobs``, serialized), checksum every file, write the manifest, rename ``temp`` to ``directory``."""
    try:
        manifest = write_parts(temp, blobs, {"format": SHARDED_FORMAT, "step": step, "meta": meta})
        shards = {}
        for file in sorted((temp / STATE_DIR).rglob("*")):
            if file.is_file():
                size, digest = file_digest(file)
                shards[str(file.relative_to(temp))] = {"bytes": size, "sha256": digest}
        index = _INDEX_FILES[layout]
        if not (temp / STATE_DIR / index).is_file():
            raise CheckpointError(f"{temp / STATE_DIR} holds no {index}: the shards were not finished")
        write_manifest(temp, {**manifest, "layout": layout, "shards": shards})
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return install(temp, directory)


def shard_entries(
    directory: Path, manifest: dict[str, Any] | None = None
) -> list[tuple[Path, dict[str, Any]]]:
    """(file, its manifest entry: bytes, sha256) of every shard file, sorted by name."""
    shards = (manifest or read_manifest(directory)).get("shards", {})
    return [(directory / name, shards[name]) for name in sorted(shards)]


def check_and_load_shards(directory: Path, manifest: dict[str, Any], *, whole_state: bool) -> dict[str, Any]:
    """For :func:`~hyperpar_gdn.train.checkpoints.whole.load_checkpoint`: every shard file is there with
    its size; with ``whole_state`` also its sha256, then the state is loaded whole, in the
    single-device row order (else ``{}``)."""
    for file, entry in shard_entries(directory, manifest):
        if not file.is_file():
            found = None
        elif whole_state:
            found = file_digest(file)
        else:
            found = (file.stat().st_size, entry["sha256"])
        check_digest(file, entry, found, directory)
    if not whole_state:
        return {}
    try:
        state = load_whole_state(directory / STATE_DIR, shard_layout(manifest))
    except (Exception, CheckpointException) as err:  # DCP's is a BaseException
        if (refused := first_checkpoint_error(err)) is not None:
            raise CheckpointError(str(refused)) from None
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(f"checkpoint {directory / STATE_DIR} could not be read: {first}") from err
    # a --tp run's fused rows, back in the single-device order (:mod:`.row_orders`)
    reorder_state(state.get("model"), state.get("optimizer"), manifest["meta"].get("row_orders", {}), {})
    return state


def verify_shards(
    directory: Path, *, rank: int, world_size: int, max_over_ranks: Callable[[int], int]
) -> str | None:
    """Collective: each rank checks the size and sha256 of every ``world_size``-th shard file
    (from its ``rank``-th), so each file is read once in all. Returns the same one line on every
    rank, naming a file that failed (``None``: every file is as the manifest says)."""
    files = shard_entries(directory)
    bad = 0
    for index in range(rank, len(files), world_size):
        file, entry = files[index]
        if not file.is_file() or file_digest(file) != (entry["bytes"], entry["sha256"]):
            bad = index + 1
            break
    bad = max_over_ranks(bad)
    if not bad:
        return None
    return f"checkpoint file {files[bad - 1][0]} is corrupt: its size or sha256 differs from {directory / MANIFEST}"


class _Writer(dcp.FileSystemWriter):
    """DCP's file writer, whose failed write raises the ``OSError`` itself: torch's serializer
    turns it into a ``RuntimeError`` whose context (lost when DCP sends the failure to the other
    ranks) is the ``OSError``, so no rank could tell a full disk from a bug."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        try:
            return super().write_data(plan, planner)
        except Exception as err:
            cause = os_error_behind(err)
            if cause is None or cause is err:
                raise
            raise OSError(cause.errno, cause.strerror, cause.filename) from err
