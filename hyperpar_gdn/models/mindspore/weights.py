"""Putting weights into MindSpore cells by parameter name: from a torch state dict (keeping the
torch dtype) or from numpy arrays (safetensors files), with every name and shape checked."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import nn

__all__ = ["DTYPES", "assign_parameters", "load_torch_state_dict", "torch_values"]

DTYPES = {"float32": ms.float32, "float64": ms.float64, "bfloat16": ms.bfloat16, "float16": ms.float16}


def assign_parameters(
    cell: nn.Cell,
    values: Mapping[str, tuple[np.ndarray, ms.Type]],
    *,
    source: str,
    allow_extra: bool = False,
) -> None:
    """Set every parameter of ``cell`` to ``values[name]`` = (array, dtype); the parameter takes
    that dtype. Every parameter must be present with its shape; an entry the cell lacks is an
    error unless ``allow_extra`` (a torch module's buffers). ``source`` names the values in errors."""
    params = dict(cell.parameters_and_names())
    missing = sorted(set(params) - set(values))
    extra = [] if allow_extra else sorted(set(values) - set(params))
    if missing or extra:
        raise ValueError(
            f"parameter names differ: {source} lacks {missing}, the MindSpore {type(cell).__name__} lacks {extra}"
        )
    for name, param in params.items():
        array, dtype = values[name]
        if tuple(array.shape) != tuple(param.shape):
            raise ValueError(
                f"{name}: {source} has shape {tuple(array.shape)}, the cell {tuple(param.shape)}"
            )
        if param.dtype != dtype:
            param.set_dtype(dtype)  # set_data alone would cast the value to the old dtype
        param.set_data(ms.Tensor(array).astype(dtype))


def torch_values(state_dict: Mapping[str, Any]) -> dict[str, tuple[np.ndarray, ms.Type]]:
    """A torch state dict as (numpy array, the torch dtype's MindSpore twin) per name (bfloat16
    travels as float32 numpy, numpy having no bfloat16)."""
    out = {}
    for name, tensor in state_dict.items():
        tensor = tensor.detach().cpu()
        dtype_name = str(tensor.dtype).removeprefix("torch.")
        if dtype_name not in DTYPES:
            raise ValueError(
                f"{name}: torch dtype {tensor.dtype} is not supported (use one of {sorted(DTYPES)})"
            )
        out[name] = (
            tensor.float().numpy() if dtype_name == "bfloat16" else tensor.numpy(),
            DTYPES[dtype_name],
        )
    return out


def load_torch_state_dict(cell: nn.Cell, state_dict: Mapping[str, Any]) -> None:
    """Copy torch tensors into ``cell``'s parameters by name, keeping the torch dtype; the two
    must have the same parameters (names and shapes)."""
    assign_parameters(cell, torch_values(state_dict), source="the torch state dict")
