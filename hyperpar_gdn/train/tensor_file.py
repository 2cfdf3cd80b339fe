"""One file of named arrays, written and read with numpy alone, in the safetensors layout.

Layout (that of the safetensors format, so its readers open these files too)::

    8 bytes       N, the header's length (unsigned, little-endian)
    N bytes       JSON: {name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}},
                  padded with spaces to a multiple of 8 bytes
    the data      each array's bytes, C order, little-endian; offsets count from here

:func:`write_arrays` streams each array from where it lies (no second copy of the file in memory)
(the widest dtypes first, so that each one is aligned) and flushes the file to disk; a refused
write is the ``OSError`` itself. :func:`read_arrays` reads a file back into writable arrays,
checking every entry against the header.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from pathlib import Path

import numpy as np

__all__ = ["read_arrays", "write_arrays"]

# numpy dtype name -> the format's dtype code
_CODES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}
_DTYPES = {code: name for name, code in _CODES.items()}


def write_arrays(path: Path, arrays: Mapping[str, np.ndarray]) -> int:
    """Write ``arrays`` (name -> array of any shape, a dtype of :data:`_CODES`) to ``path``,
    flushed to disk; returns the file's size in bytes."""
    header: dict[str, dict[str, object]] = {}
    ordered = []
    offset = 0
    # widest items first: every array then starts at a multiple of its item size (aligned reads)
    for name in sorted(arrays, key=lambda n: -arrays[n].dtype.itemsize):
        array = arrays[name]
        code = _CODES.get(array.dtype.name)
        if code is None:
            raise ValueError(
                f"array {name!r} has dtype {array.dtype}; a tensor file holds {', '.join(_CODES)}"
            )
        array = np.asarray(array, dtype=array.dtype.newbyteorder("<"), order="C")  # keeps 0-d arrays
        header[name] = {
            "dtype": code,
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        ordered.append(array)
        offset += array.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(text)))
        handle.write(text)
        for array in ordered:
            handle.write(array.reshape(-1).view(np.uint8).data)
        handle.flush()
        os.fsync(handle.fileno())
    return 8 + len(text) + offset


def read_arrays(path: Path) -> dict[str, np.ndarray]:
    """The arrays of a file :func:`write_arrays` wrote (or any safetensors file of those dtypes),
    by name; ``ValueError`` naming ``path`` when the header and the data disagree."""
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) != 8:
            raise ValueError(f"{path} is shorter than a tensor file's 8-byte header length")
        (length,) = struct.unpack("<Q", head)
        try:
            header = json.loads(handle.read(length))
        except ValueError as err:
            raise ValueError(f"{path} has an unreadable header: {err}") from err
        data = bytearray(os.fstat(handle.fileno()).st_size - 8 - length)
        got = handle.readinto(data)
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a tensor file (its header is not a JSON object)")
    if got != len(data):
        raise ValueError(f"{path} ended while it was read ({got} of {len(data)} data bytes)")
    header.pop("__metadata__", None)
    arrays = {}
    for name, entry in header.items():
        try:
            dtype = np.dtype(_DTYPES[entry["dtype"]]).newbyteorder("<")
            shape = tuple(int(n) for n in entry["shape"])
            begin, end = (int(n) for n in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{path}: entry {name!r} is malformed ({type(err).__name__}: {err})") from err
        if end - begin != math.prod(shape) * dtype.itemsize or not 0 <= begin <= end <= len(data):
            raise ValueError(
                f"{path}: entry {name!r} of shape {shape} spans bytes [{begin}, {end}) of {len(data)}"
            )
        if math.prod(shape) == 0:
            arrays[name] = np.zeros(shape, dtype)
        else:
            arrays[name] = np.frombuffer(data, dtype, count=math.prod(shape), offset=begin).reshape(shape)
    return arrays
