"""Read and write the weights of a transformers model directory as numpy arrays, without torch.

Reads ``model.safetensors`` or a sharded ``model.safetensors.index.json`` with safetensors' numpy
API; bfloat16 tensors (numpy has none, and Qwen3.5 checkpoints are bfloat16) are read from the
file's raw bytes and widened exactly to float32. Writes one ``model.safetensors`` with the
``{"format": "pt"}`` metadata that transformers expects.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np

__all__ = ["read_weights", "write_weights"]

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"


def read_weights(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of the model directory ``path``, by its name in the files."""
    root = Path(path)
    if (root / INDEX).is_file():
        weight_map = json.loads((root / INDEX).read_text()).get("weight_map", {})
        files = sorted(set(weight_map.values()))
    elif (root / SINGLE).is_file():
        files = [SINGLE]
    else:
        raise FileNotFoundError(
            f"{path}: neither {SINGLE} nor {INDEX} (a transformers model directory's weights)"
        )
    arrays: dict[str, np.ndarray] = {}
    for name in files:
        arrays.update(_read_file(root / name))
    return arrays


def write_weights(path: str | Path, arrays: Mapping[str, np.ndarray]) -> Path:
    """Write ``arrays`` as ``path/model.safetensors``; returns the file."""
    from safetensors.numpy import save_file

    file = Path(path) / SINGLE
    save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(file), metadata={"format": "pt"})
    return file


def _read_file(file: Path) -> dict[str, np.ndarray]:
    from safetensors import safe_open

    with file.open("rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    out = {}
    with safe_open(str(file), framework="numpy") as f:
        for name in f.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
            entry = header[name]
            if entry["dtype"] == "BF16":
                start, end = entry["data_offsets"]
                raw = np.fromfile(file, dtype="<u2", count=(end - start) // 2, offset=8 + header_len + start)
                out[name] = (raw.astype(np.uint32) << 16).view(np.float32).reshape(entry["shape"])
            else:
                out[name] = f.get_tensor(name)
    return out
