"""Tensor parallelism for whole MindSpore models, and the parts put back together.

``apply_tensor_parallel(model, mesh["tp"])`` splits every decoder block of a MindSpore
``HybridLM`` or ``Qwen3_5ForCausalLM`` (dense or MoE) by the styles of :mod:`.mindspore_styles`,
after checking them all; :func:`whole_parameters` gathers a TP model's (or cell's) parameters or
gradients into the one-device layout. Example (4 ranks: cp = 2 x tp = 2, under
``HP_PLATFORM=mindspore``)::

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    apply_tensor_parallel(model, mesh["tp"])
    apply_context_parallel(model, mesh["cp"], mode="p2p")
"""

from __future__ import annotations

from typing import Any

import mindspore as ms
import numpy as np
from mindspore import nn

from hyperpar_gdn.distributed.decoder_layers import find_decoder, mixer_of
from hyperpar_gdn.ops.head_shard import head_shard_of
from hyperpar_gdn.tensor_parallel.mindspore_styles import (
    AttentionTensorParallel,
    GatedDeltaNetTensorParallel,
    MLPTensorParallel,
    MoETensorParallel,
    TensorParallel,
)

__all__ = ["apply_tensor_parallel", "whole_parameters"]


def apply_tensor_parallel(model: nn.Cell, tp_mesh: Any) -> nn.Cell:
    """Split every decoder block of a MindSpore ``HybridLM`` or ``Qwen3_5ForCausalLM`` (dense or
    MoE) over the 1-D TP mesh: the GDN layers, the attention, the MLPs and the MoE blocks by the
    styles above; the embedding, the norms between blocks and the head stay whole (the same
    computation on every TP rank). Checks every block before changing any (one ``ValueError`` on
    every rank, no communication, the model left as it was). Returns ``model``, changed in place."""
    _, text_model = find_decoder(model)
    tp, plan, errors = tp_mesh.size(), [], []
    for i, block in enumerate(text_model.layers):
        kind, mixer = mixer_of(i, block)
        mlp = getattr(block, "mlp", None)
        if all(hasattr(mlp, n) for n in ("gate", "experts", "shared_expert", "shared_expert_gate")):
            mlp_style: TensorParallel = MoETensorParallel()
        elif all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            mlp_style = MLPTensorParallel()
        else:
            errors.append(f"layer {i}: {type(mlp).__name__} is not a SwiGLU MLP or MoE block the plan covers")
            continue
        mixer_style = GatedDeltaNetTensorParallel() if kind == "linear_attn" else AttentionTensorParallel()
        for cell, style in ((mixer, mixer_style), (mlp, mlp_style)):
            error = style.refusal(cell, tp)
            if error is not None:
                errors.append(f"layer {i}: {error}")
            plan.append((cell, style))
    if errors:
        raise ValueError("; ".join(errors))
    for cell, style in plan:
        style.apply(cell, tp_mesh)
    return model


def whole_parameters(cell: nn.Cell, values: dict[str, ms.Tensor], tp_mesh: Any) -> dict[str, np.ndarray]:
    """``values`` by parameter name relative to ``cell`` (a split cell or a model holding some;
    its parameters, or their gradients) on this TP rank -> numpy arrays in the one-device layout:
    the split ones gathered over the TP group (collective: every TP rank calls it with the same
    names), the others as they are (whole on every rank; their gradients already summed over tp)."""
    shards = {prefix: head_shard_of(sub) for prefix, sub in cell.cells_and_names()}
    splits = {prefix: shard for prefix, shard in shards.items() if shard is not None}
    if not splits:
        raise ValueError(f"{type(cell).__name__} has no tensor parallelism applied")
    comm, group, platform = tp_mesh.platform.collectives, tp_mesh.get_group(), tp_mesh.platform
    whole = {}
    for name in sorted(values):
        found = [
            (split, name.removeprefix(prefix + "." if prefix else ""))
            for prefix, split in splits.items()
            if not prefix or name.startswith(prefix + ".")
        ]
        found = [(split, local) for split, local in found if local in split.shapes]
        if not found:
            whole[name] = platform.to_numpy(values[name])
            continue
        split, local = found[0]
        gathered = platform.to_numpy(comm.all_gather(values[name], group))  # [tp, *local shape]
        out = np.zeros(split.shapes[local], gathered.dtype)
        for rank in range(split.size):
            dim, index = split.parts(rank)[local]
            np.moveaxis(out, dim, 0)[index] = np.moveaxis(gathered[rank], dim, 0)
        whole[name] = out
    return whole
