"""Reading torch's distributed checkpoints (DCP) as data: nothing in a checkpoint can run code.

DCP keeps two things as pickles: its index (``state/.metadata``, one ``pickle.load``) and every
entry that is not a tensor (the optimizer's ``param_groups``: floats, booleans, names), which its
default load planner reads with ``torch.load(weights_only=False)``. A pickle can name any
callable, and unpickling calls it: a checkpoint from elsewhere, with its manifest's digests
redone, would run whatever it names when a run resumes from it. Here:

- :class:`DataReader` reads the index with an unpickler that knows only DCP's own metadata
  classes, ``torch.Size``, the dtypes and layouts, and paths (:data:`_METADATA_GLOBALS`);
- :class:`DataLoadPlanner` reads every non-tensor entry with ``torch.load(weights_only=True)``
  (plain containers, numbers, strings, tensors);

and anything else is refused before it is called, with :class:`CheckpointError` naming the entry
and what it named (:func:`refusal`). Tensors were already read with ``weights_only=True`` by DCP.
"""

from __future__ import annotations

import io
import pathlib
import pickle
import re
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import ReadItem

from hyperpar_gdn.train.errors import CheckpointError

__all__ = ["DataLoadPlanner", "DataReader", "first_checkpoint_error", "refusal"]

# What DCP's index may name, by module: the classes it pickles (filesystem._StorageInfo: where a
# piece sits in which file), torch.Size, torch's dtypes (checked below) and layouts (by name),
# and the checkpoint's path.
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
}


class _Refused(pickle.UnpicklingError):
    """A pickle named ``name``, which reading as data does not allow."""

    def __init__(self, name: str) -> None:
        super().__init__(f"Unsupported global: GLOBAL {name}")
        self.name = name


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _Refused(f"{module}.{name}")


def refusal(err: BaseException) -> str:
    """What a refused pickle named, in a few words (from our unpickler's or torch's
    ``weights_only`` error, whose text is many lines)."""
    text = str(err)
    if found := re.search(r"Unsupported global: GLOBAL ([\w.]+)", text):
        return f"it names {found.group(1)}, which is not data"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return next(
        (line for line in lines if "WeightsUnpickler error" in line),
        lines[0] if lines else type(err).__name__,
    )


class DataReader(dcp.FileSystemReader):
    """DCP's file reader, whose index (``.metadata``) is unpickled as data only."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = pathlib.Path(self._get_metadata_path(kwargs.get("rank")))
        try:
            with open(path, "rb") as handle:
                metadata = _MetadataUnpickler(handle).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as err:
            raise CheckpointError(
                f"checkpoint file {path} was refused unread: {refusal(err)} (a checkpoint is read as data)"
            ) from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp.metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class DataLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading each non-tensor entry with ``weights_only=True``;
    ``directory`` (the ``state/`` read) names the checkpoint in its errors."""

    def __init__(self, directory: str | pathlib.Path, **options: Any) -> None:
        super().__init__(**options)
        self.directory = directory

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise CheckpointError(
                f"checkpoint entry {fqn} in {self.directory} was refused unread: {refusal(err)} "
                "(a checkpoint is read as data)"
            ) from None
        if self.flatten_state_dict:  # where DefaultLoadPlanner.load_bytes puts it
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def first_checkpoint_error(err: BaseException) -> CheckpointError | None:
    """The :class:`CheckpointError` that a rank raised inside DCP (which gathers every rank's
    failures into one ``CheckpointException`` on every rank), or ``err`` itself when it is one."""
    if isinstance(err, CheckpointError):
        return err
    if isinstance(err, CheckpointException):
        for _, failure in sorted(err.failures.items(), key=lambda item: item[0]):
            found = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(found, CheckpointError):
                return found
    return None
