"""Checkpoints of the context-parallel Trainer under ``tp_size`` or ``ep_size``: every rank's
parameter shards and optimizer state, so that ``train(resume_from_checkpoint=...)`` continues
exactly.

Under tensor or expert parallelism each rank holds its own ``DTensor`` shards (heads and columns
over tp, experts over ep), and its optimizer state holds the same shards. The checkpoint directory
keeps transformers' files (the whole weights written by rank 0 through ``save_model``, the
scheduler, the trainer state, one RNG file per rank) and adds::

    parallel_sizes.json          {"world", "dp", "cp", "tp", "ep"} of the run that saved it
    rank<r>-of-<W>-model.pt      rank r's model state, its shards as local tensors
    rank<r>-of-<W>-optimizer.pt  rank r's optimizer state dict, its shards as local tensors, and
                                 "dtensor_state": [[param index, state key], ...] naming them

Every file loads data-only (``torch.load(..., weights_only=True)``). A resume reads the sizes
first and refuses, on every rank before any communication, a run at other sizes.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["check_saved_sizes", "load_model_shards", "load_optimizer_shards", "save_rank_state"]

SIZES_NAME = "parallel_sizes.json"
SCHEDULER_NAME = "scheduler.pt"  # transformers' name for the learning-rate scheduler's state


def _rank_file(checkpoint: str, what: str, rank: int, world: int) -> str:
    return os.path.join(checkpoint, f"rank{rank}-of-{world}-{what}.pt")


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach()


def save_rank_state(
    output_dir: str,
    *,
    model: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    sizes: dict[str, int],
    rank: int,
) -> None:
    """Write this rank's model shards and optimizer state; rank 0 also the sizes and the
    scheduler's state (the same on every rank)."""
    os.makedirs(output_dir, exist_ok=True)
    world = sizes["world"]
    model_state = {name: _local(t) for name, t in model.state_dict(keep_vars=True).items()}
    torch.save(model_state, _rank_file(output_dir, "model", rank, world))
    optim = optimizer.state_dict()
    dtensor_state, state = [], {}
    for index, entries in optim["state"].items():  # new dicts: the optimizer's own stay as they are
        state[index] = {key: _local(value) for key, value in entries.items()}
        dtensor_state += [[index, key] for key, value in entries.items() if isinstance(value, DTensor)]
    optim = {**optim, "state": state, "dtensor_state": dtensor_state}
    torch.save(optim, _rank_file(output_dir, "optimizer", rank, world))
    if rank == 0:
        with open(os.path.join(output_dir, SIZES_NAME), "w") as f:
            json.dump(sizes, f)
        with warnings.catch_warnings():  # the scheduler's reminder to save the optimizer too
            warnings.simplefilter("ignore", UserWarning)
            torch.save(scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))


def _describe(sizes: dict[str, int]) -> str:
    return (
        " x ".join(f"{axis}{sizes[axis]}" for axis in ("dp", "cp", "tp", "ep"))
        + f" ({sizes['world']} processes)"
    )


def check_saved_sizes(checkpoint: str, sizes: dict[str, int], *, sharded: bool) -> None:
    """Refuse a resume at sizes other than the checkpoint's (a ValueError naming both), and a run
    that needs per-rank state (``sharded``: tp or ep above one) from a checkpoint without it."""
    if not os.path.isdir(checkpoint):
        raise ValueError(f"resume_from_checkpoint={checkpoint!r} is not a checkpoint directory")
    path = os.path.join(checkpoint, SIZES_NAME)
    if not os.path.isfile(path):
        if sharded:
            raise ValueError(
                f"resume_from_checkpoint={checkpoint!r} holds no per-rank state ({SIZES_NAME} missing: saved "
                f"without tp_size/ep_size, or with save_only_model) and this run is {_describe(sizes)}; resume "
                "at the sizes it was saved at, or train from its saved model"
            )
        return
    with open(path) as f:
        saved = {key: int(value) for key, value in json.load(f).items()}
    if saved != sizes:
        raise ValueError(
            f"resume_from_checkpoint={checkpoint!r} was saved at {_describe(saved)} and this run is "
            f"{_describe(sizes)}: resume at the sizes it was saved at"
        )


def _load(path: str) -> Any:
    if not os.path.isfile(path):
        raise ValueError(f"{path} is missing: every rank of the saving run writes its own")
    return torch.load(path, map_location="cpu", weights_only=True)


def load_model_shards(checkpoint: str, model: torch.nn.Module, *, rank: int, world: int) -> None:
    """Copy this rank's saved tensors into ``model``'s (its shards' local tensors)."""
    path = _rank_file(checkpoint, "model", rank, world)
    saved = _load(path)
    current = model.state_dict(keep_vars=True)
    if current.keys() != saved.keys():
        missing, extra = sorted(current.keys() - saved.keys()), sorted(saved.keys() - current.keys())
        raise ValueError(
            f"{path}: other tensors than the model's (missing {missing[:3]}, unexpected {extra[:3]})"
        )
    with torch.no_grad():
        for name, value in current.items():
            local = _local(value)
            if local.shape != saved[name].shape:
                raise ValueError(
                    f"{path}: {name} is {tuple(saved[name].shape)}, this rank's {tuple(local.shape)}"
                )
            local.copy_(saved[name])


def load_optimizer_shards(checkpoint: str, optimizer: Any, scheduler: Any, *, rank: int, world: int) -> None:
    """Load this rank's optimizer state (its shards back as ``DTensor`` on their parameters'
    meshes) and the scheduler's."""
    path = _rank_file(checkpoint, "optimizer", rank, world)
    optim = _load(path)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    indices = [i for group in optim["param_groups"] for i in group["params"]]
    if len(params) != len(indices):
        raise ValueError(f"{path}: {len(indices)} parameters saved, this optimizer has {len(params)}")
    by_index = dict(zip(indices, params, strict=True))
    for index, key in optim.pop("dtensor_state"):
        p = by_index[index]
        local = optim["state"][index][key].to(p.device)
        optim["state"][index][key] = DTensor.from_local(
            local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )
    optimizer.load_state_dict(optim)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))
