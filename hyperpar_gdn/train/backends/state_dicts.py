"""Full state dicts of a torch model, with or without FSDP2 and activation checkpointing.

Checkpoints hold full (gathered) state dicts with parameter names as keys, whatever
:mod:`hyperpar_gdn.parallel` did to the model, so a run saved with ``--fsdp`` resumes without it
and back.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

__all__ = [
    "full_model_state_dict",
    "full_state_dicts",
    "load_full_state_dicts",
]

_SAVE = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered on rank 0, on the CPU
_LOAD = StateDictOptions(full_state_dict=True)  # every rank holds the full dicts it read


def full_model_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """The model's state dict keyed by parameter names, whole, on rank 0 (collective under FSDP:
    every rank must call it; the other ranks get an empty dict)."""
    return get_model_state_dict(model, options=_SAVE)


def full_state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(model, optimizer) state dicts keyed by parameter names, whole, on rank 0 (collective
    under FSDP: every rank must call it; the other ranks get empty dicts)."""
    return full_model_state_dict(model), get_optimizer_state_dict(model, optimizer, options=_SAVE)


def load_full_state_dicts(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    model_state: dict[str, Any],
    optimizer_state: dict,
) -> None:
    """Load full state dicts (as :func:`full_state_dicts` writes them) on every rank."""
    set_model_state_dict(model, model_state, options=_LOAD)
    set_optimizer_state_dict(model, optimizer, optimizer_state, options=_LOAD)
