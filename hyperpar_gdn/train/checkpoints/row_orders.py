"""The row order of the fused projections in a checkpoint, and the moves between orders.

A tensor-parallel model (``--tp``) holds its fused projections in an order that does not depend
on tp but is not the single-device one: ``in_proj_qkv`` and the conv weight grouped by q/k head
(:func:`~hyperpar_gdn.planning.tp_rules.qkv_grouped_order`), the experts' ``gate_up_proj``
with gate row u beside up row u (:func:`~hyperpar_gdn.planning.tp_rules.gate_up_interleaved_order`).
So each TP rank's shard is one block of rows, and a sharded (DCP) checkpoint saved at tp 2 loads
at tp 4 as it is. Everything else is in the single-device (canonical) order: whole checkpoints,
exports, sharded checkpoints of runs without ``--tp``.

A checkpoint's manifest meta says which under ``"row_orders"``: ``{name: spec}`` for every
tensor held in another order (none: canonical), a spec being ``{"kind": "qkv", "dim": 0,
"sizes": [k heads, k head dim, v heads, v head dim]}`` or ``{"kind": "gate_up", "dim": 1,
"sizes": [intermediate]}``. The optimizer's moments of a parameter follow its rows.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hyperpar_gdn.ops.head_shard import head_shard_of
from hyperpar_gdn.planning.tp_rules import gate_up_interleaved_order, qkv_grouped_order

__all__ = [
    "changed_names",
    "from_canonical",
    "model_row_orders",
    "move_rows",
    "reorder_state",
    "to_canonical",
]

Spec = dict[str, Any]
MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's per-parameter tensors (their rows follow it)


def model_row_orders(model: torch.nn.Module) -> dict[str, Spec]:
    """The specs of ``model``'s tensors held out of canonical order (empty without tensor
    parallelism), by state-dict name (activation checkpointing's wrappers left out of the names,
    as the state dict leaves them)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX

    specs: dict[str, Spec] = {}
    for name, module in model.named_modules():
        shard = head_shard_of(module)
        name = name.replace(_CHECKPOINT_PREFIX, "")
        prefix = f"{name}." if name else ""
        if shard is not None and shard.kind == "gdn":
            for tensor in ("in_proj_qkv.weight", "conv1d.weight"):
                specs[prefix + tensor] = {"kind": "qkv", "dim": 0, "sizes": list(shard.sizes)}
        elif shard is not None and shard.kind == "moe":
            specs[prefix + "experts.gate_up_proj"] = {"kind": "gate_up", "dim": 1, "sizes": list(shard.sizes)}
    return specs


def _order(spec: Spec) -> np.ndarray:
    """The canonical row of each row in ``spec``'s order."""
    if spec["kind"] == "qkv":
        return qkv_grouped_order(*spec["sizes"])
    if spec["kind"] == "gate_up":
        return gate_up_interleaved_order(*spec["sizes"])
    raise ValueError(f"row order {spec!r} is not one this version reads (qkv, gate_up)")


def to_canonical(tensor: torch.Tensor, spec: Spec) -> torch.Tensor:
    """``tensor`` (whole, in ``spec``'s order) in the canonical order."""
    inverse = torch.as_tensor(np.argsort(_order(spec)), device=tensor.device)
    return tensor.index_select(spec["dim"], inverse)


def from_canonical(tensor: torch.Tensor, spec: Spec) -> torch.Tensor:
    """``tensor`` (whole, canonical) in ``spec``'s order."""
    return tensor.index_select(spec["dim"], torch.as_tensor(_order(spec), device=tensor.device))


def move_rows(tensor: torch.Tensor, saved: Spec | None, wanted: Spec | None) -> torch.Tensor:
    """``tensor`` (whole) from the order ``saved`` to the order ``wanted`` (None: canonical)."""
    if saved == wanted:
        return tensor
    canonical = tensor if saved is None else to_canonical(tensor, saved)
    return canonical if wanted is None else from_canonical(canonical, wanted)


def changed_names(saved: dict[str, Spec], wanted: dict[str, Spec]) -> list[str]:
    """The names whose order differs between ``saved`` and ``wanted``."""
    return sorted(n for n in set(saved) | set(wanted) if saved.get(n) != wanted.get(n))


def reorder_state(
    model_state: dict[str, Any] | None,
    optimizer_state: dict[str, Any] | None,
    saved: dict[str, Spec],
    wanted: dict[str, Spec],
) -> None:
    """Move the whole tensors of a model state dict and of an optimizer state dict keyed by
    parameter names (as ``get_optimizer_state_dict`` gives it) from the orders ``saved`` to
    ``wanted``, in place; empty dicts (the ranks other than 0 of a gathered state) stay empty."""
    for name in changed_names(saved, wanted):
        old, new = saved.get(name), wanted.get(name)
        if model_state and name in model_state:
            model_state[name] = move_rows(model_state[name], old, new)
        moments = (optimizer_state or {}).get("state", {}).get(name, {})
        for key in MOMENTS:
            if key in moments:
                moments[key] = move_rows(moments[key], old, new)
