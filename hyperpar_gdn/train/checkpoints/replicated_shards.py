"""Sharded checkpoints of a replicated state: every rank writes a disjoint part of it.

Where the model and its optimizer state are the same on every rank (MindSpore's training: no
FSDP, parameters replicated over the CP and DP ranks), a sharded save needs no gathering and no
exchange: every rank computes the same split (:func:`assign`: the tensors by size, largest first,
each to the rank that holds the fewest bytes so far) and writes its own tensors, in parallel. No
rank writes, or copies to the host, more than its part. Loading reads every part (each rank
holds the whole state anyway), so a checkpoint resumes at any CP or DP size.

Layout of ``step-N/state/`` (the ``"replicated"`` layout of the sharded format, format 2; the
commit, manifest and checks are :mod:`.sharded`'s)::

    index.json              the state's structure (rank 0): nested dicts and lists whose tensors
                            are {"tensor": key, "file", "shape", "dtype"}, the small values (the
                            optimizer's format, step count, names) as they are; the world size
    rank-<r>.safetensors    rank r's tensors by key (a safetensors file: :func:`write_part`)

The state is given as nested dicts and lists whose tensors are :class:`Leaf` objects: a shape, a
dtype and a way to copy the tensor to the host, called only for the tensors this rank writes.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hyperpar_gdn.train.checkpoints.directory import fsync_path, write_flushed
from hyperpar_gdn.train.errors import CheckpointError

__all__ = [
    "INDEX",
    "Leaf",
    "assign",
    "load_replicated",
    "part_file",
    "read_part",
    "write_part",
    "write_replicated_shards",
]

INDEX = "index.json"
_TENSOR = "tensor"  # the key that marks a tensor's entry in the index
# the dtypes a part holds (numpy's names): those of the states saved, which every safetensors reads
PART_DTYPES = ("float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8", "bool")


@dataclass(frozen=True)
class Leaf:
    """A tensor of the state: its shape, numpy dtype name, and ``read()``, which returns a host
    copy of it (an array that later training steps do not change)."""

    shape: tuple[int, ...]
    dtype: str
    read: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def part_file(rank: int) -> str:
    """The file rank ``rank`` writes under ``state/``."""
    return f"rank-{rank}.safetensors"


def assign(sizes: Sequence[int], world_size: int) -> list[int]:
    """The rank that writes each tensor (of ``sizes`` bytes): largest first (ties by position),
    each to the rank with the fewest bytes so far (the lowest such rank). The same on every rank."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    owners = [0] * len(sizes)
    load = [0] * world_size
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[index] = rank
        load[rank] += sizes[index]
    return owners


def write_replicated_shards(
    state: Any,
    directory: Path,
    *,
    rank: int,
    world_size: int,
    max_over_ranks: Callable[[int], int],
    background: bool = False,
) -> Future | None:
    """Collective (one reduction): this rank's part of ``state`` (its :class:`Leaf` tensors copied
    to the host now) goes to ``directory/rank-<rank>.safetensors``; rank 0 also writes the index.
    A tensor holding NaN or inf on any rank is a ``CheckpointError`` on every rank, before any
    file. ``background``: a thread writes the part; returns its future."""
    index, leaves = _flatten(state, "")
    keys = list(leaves)
    owners = assign([leaves[key].nbytes for key in keys], world_size)
    mine = {key: leaves[key].read() for key, owner in zip(keys, owners, strict=True) if owner == rank}
    bad = [key for key, array in mine.items() if array.dtype.kind == "f" and not np.isfinite(array).all()]
    if max_over_ranks(int(bool(bad))):
        names = ", ".join(bad[:3]) if bad else "another rank's tensors"
        raise CheckpointError(f"refusing to save into {directory}: {names} hold NaN or inf values")
    directory.mkdir(exist_ok=True)
    if rank == 0:
        files = {key: part_file(owner) for key, owner in zip(keys, owners, strict=True)}
        text = json.dumps({"world_size": world_size, "state": _with_files(index, files)}, indent=1)
        write_flushed(directory / INDEX, text.encode())
    target = directory / part_file(rank)
    if not background:
        write_part(target, mine)
        return None
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hp-save")
    future = executor.submit(write_part, target, mine)
    executor.shutdown(wait=False)  # the thread ends with its write
    return future


def write_part(path: Path, arrays: Mapping[str, np.ndarray]) -> None:
    """Write ``arrays`` (name -> array of any shape, a dtype of :data:`PART_DTYPES`) to the
    safetensors file ``path``, flushed to disk; a write the system refused raises its ``OSError``
    (errno and file), as a write of this project's own does."""
    from safetensors import SafetensorError
    from safetensors.numpy import save_file

    for name, array in arrays.items():
        if array.dtype.name not in PART_DTYPES:
            raise ValueError(
                f"array {name!r} has dtype {array.dtype}; a checkpoint part holds {', '.join(PART_DTYPES)}"
            )
    # safetensors writes each array's memory as it lies: a strided view is copied to C order first
    ordered = {name: a if a.flags.c_contiguous else a.copy(order="C") for name, a in arrays.items()}
    try:
        save_file(ordered, path)
    except SafetensorError as err:  # its I/O errors end in "(os error N)"
        found = re.search(r"\(os error (\d+)\)", str(err))
        if found is None:
            raise
        errno = int(found.group(1))
        raise OSError(errno, os.strerror(errno), str(path)) from err
    fsync_path(path)


def read_part(path: Path) -> dict[str, np.ndarray]:
    """The arrays of a part (any safetensors file, such as those written before this reader), by
    name, each a writable copy; ``CheckpointError`` naming ``path`` when the file is unreadable."""
    try:
        from safetensors import SafetensorError
        from safetensors.numpy import load_file
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            f"reading {path} (a replicated checkpoint's part, written on MindSpore) needs the safetensors "
            "package: pip install safetensors (the mindspore and transformers extras bring it)"
        ) from err
    try:
        return load_file(path)
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"checkpoint file {path} could not be read: {err}") from err


def load_replicated(directory: Path) -> Any:
    """The whole state under ``directory`` (every part read), with numpy arrays for its tensors;
    ``CheckpointError`` naming the file that lacks a tensor of the index, or has it in another shape."""
    try:
        index = json.loads((directory / INDEX).read_text())["state"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{directory / INDEX} could not be read: {type(err).__name__}: {err}") from err
    parts: dict[str, dict[str, np.ndarray]] = {}

    def build(node: Any) -> Any:
        if isinstance(node, dict) and _TENSOR in node:
            file = directory / node["file"]
            if node["file"] not in parts:
                parts[node["file"]] = read_part(file)
            array = parts[node["file"]].get(node[_TENSOR])
            if array is None or list(array.shape) != node["shape"] or array.dtype.name != node["dtype"]:
                found = "nothing" if array is None else f"{array.dtype} {list(array.shape)}"
                raise CheckpointError(
                    f"checkpoint file {file} holds {found} for {node[_TENSOR]}, not "
                    f"{node['dtype']} {node['shape']} as {directory / INDEX} says"
                )
            return array
        if isinstance(node, dict):
            return {key: build(value) for key, value in node.items()}
        if isinstance(node, list):
            return [build(value) for value in node]
        return node

    return build(index)


def _flatten(node: Any, key: str) -> tuple[Any, dict[str, Leaf]]:
    """(the index without files: each Leaf an entry, the leaves by their dotted key)."""
    if isinstance(node, Leaf):
        return {_TENSOR: key, "shape": list(node.shape), "dtype": node.dtype}, {key: node}
    if isinstance(node, (dict, list, tuple)):
        items = node.items() if isinstance(node, dict) else enumerate(node)
        out: Any = {} if isinstance(node, dict) else []
        leaves: dict[str, Leaf] = {}
        for name, value in items:
            if isinstance(node, dict) and (not isinstance(name, str) or name == _TENSOR):
                raise ValueError(
                    f"state key {name!r} under {key or 'the top'}: keys are strings other than {_TENSOR!r}"
                )
            entry, found = _flatten(value, f"{key}.{name}" if key else str(name))
            if clash := found.keys() & leaves.keys():
                raise ValueError(f"state tensors share the key {sorted(clash)[0]!r}")
            leaves.update(found)
            if isinstance(node, dict):
                out[name] = entry
            else:
                out.append(entry)
        return out, leaves
    if node is None or isinstance(node, (str, int, float, bool)):
        return node, {}
    raise ValueError(
        f"state entry {key!r} is a {type(node).__name__}: a Leaf, dict, list or JSON value is saved"
    )


def _with_files(node: Any, files: dict[str, str]) -> Any:
    if isinstance(node, dict) and _TENSOR in node:
        return {**node, "file": files[node[_TENSOR]]}
    if isinstance(node, dict):
        return {key: _with_files(value, files) for key, value in node.items()}
    if isinstance(node, list):
        return [_with_files(value, files) for value in node]
    return node
