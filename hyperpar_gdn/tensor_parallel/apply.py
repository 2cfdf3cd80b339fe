"""Tensor parallelism for whole Qwen3.5 models (torch): every decoder block split by heads and columns.

``apply_tensor_parallel(model, mesh["tp"])`` reads like torch's ``parallelize_module`` and
:func:`~hyperpar_gdn.apply_context_parallel`: it builds the plan of the model (one
:mod:`.styles` style per token mixer and per MLP or MoE block), checks every block
before changing any, and applies the plan with torch's ``parallelize_module``. Parameters become
``DTensor`` shards on the TP mesh (FSDP2 on a DP axis and DCP see them as such); the embedding,
the norms between blocks and the LM head stay whole on every rank (their computation is the same
on every TP rank).

Serves what :func:`~hyperpar_gdn.apply_context_parallel` serves on torch: ``HybridLM`` and
transformers' ``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``, their text models and the
language model of ``Qwen3_5ForConditionalGeneration`` (the vision tower stays whole).

Context parallelism composes: apply tensor parallelism first, then
``apply_context_parallel(model, mesh["cp"], ...)`` on a mesh ``(dp, cp, tp)`` (tp innermost): every
CP mode then runs on each TP rank's local heads (ulysses and ulysses_hidden split the local value
heads again, so the value heads must be divisible by tp x cp).

Example (4 ranks: tp = 2 x cp = 2)::

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    apply_tensor_parallel(model, mesh["tp"])
    apply_context_parallel(model, mesh["cp"], mode="p2p")
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from hyperpar_gdn.distributed.decoder_layers import find_decoder, is_silu, mixer_of, module_adapter_for
from hyperpar_gdn.distributed.mesh import DeviceMesh
from hyperpar_gdn.distributed.parallel_style import is_parallelized
from hyperpar_gdn.expert_parallel.style import EP_RECORD, is_moe_block
from hyperpar_gdn.ops.gdn.layer import LayerDims
from hyperpar_gdn.ops.head_shard import head_shard_of
from hyperpar_gdn.ops.projections import wrapper_of
from hyperpar_gdn.planning.tp_rules import (
    attention_head_error,
    gate_up_interleaved_order,
    qkv_grouped_order,
    tensor_parallel_head_error,
)
from hyperpar_gdn.tensor_parallel.styles import (
    AttentionTensorParallel,
    GatedDeltaNetTensorParallel,
    MLPTensorParallel,
    MoETensorParallel,
)

__all__ = [
    "apply_tensor_parallel",
    "as_tp_mesh",
    "canonical_grads",
    "canonical_state_dict",
    "tensor_parallel_plan",
]


def apply_tensor_parallel(model: Any, mesh: Any) -> Any:
    """Split every decoder block of ``model`` over the 1-D TP ``mesh`` (e.g. ``mesh["tp"]``).

    GDN layers by q/k heads with their value heads (``num_k_heads`` divisible by tp), softmax
    attention by query heads (K/V heads split when tp divides them, else whole on every rank with
    tp a multiple of them), MLPs and experts by columns; each block's output is summed over the TP
    ranks. Every rank passes the same input (its CP shard under context parallelism) and gets the
    same output. Checks every block before changing any: a wrong set-up is one ``ValueError`` on
    every rank, before any communication, and the model is left as it was.

    Args:
        model: ``HybridLM`` or transformers' Qwen3.5 causal LM / text model / multimodal model
            (torch), before :func:`~hyperpar_gdn.apply_context_parallel`.
        mesh: the 1-D TP axis: ours (``init_device_mesh(...)["tp"]``) or a torch ``DeviceMesh``.

    Returns ``model``, changed in place (there is no undo: the parameters are re-made as shards,
    and the installed forwards stay: :meth:`~hyperpar_gdn.distributed.adapters.ModelAdapter.keep_installed_forwards`).
    """
    tp_mesh = as_tp_mesh(mesh)
    _, text_model = find_decoder(model)
    plan = tensor_parallel_plan(text_model, tp_mesh.size())
    module_adapter_for(text_model).keep_installed_forwards(model)
    parallelize_module(text_model, tp_mesh, plan)
    return model


def as_tp_mesh(mesh: Any) -> Any:
    """The 1-D torch ``DeviceMesh`` of a TP axis: a torch mesh as it is, or ours wrapped around its
    process group (no communication)."""
    from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh

    if isinstance(mesh, TorchDeviceMesh):
        if mesh.ndim != 1:
            raise ValueError(
                f"tensor parallelism needs a 1-D mesh; got shape {tuple(mesh.shape)} with dim names "
                f"{mesh.mesh_dim_names}: pass one axis, e.g. mesh['tp']"
            )
        return mesh
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"expected a DeviceMesh (ours or torch's), got {type(mesh).__qualname__}")
    if mesh.ndim != 1:
        raise ValueError(
            f"tensor parallelism needs a 1-D mesh; got shape {mesh.shape} with dim names "
            f"{mesh.mesh_dim_names}: pass one axis, e.g. mesh['tp']"
        )
    if mesh.platform.name == "mindspore":
        raise NotImplementedError(
            "this is torch's tensor parallelism; on a MindSpore mesh use "
            "hyperpar_gdn.tensor_parallel.mindspore_styles.apply_tensor_parallel"
        )
    if mesh.device_type not in ("cpu", "cuda", "npu"):
        raise NotImplementedError(
            f"tensor parallelism runs on torch (cpu, cuda, npu); this mesh is {mesh.device_type!r}"
        )
    names = mesh.mesh_dim_names
    return TorchDeviceMesh.from_group(
        mesh.get_group(), mesh.device_type, mesh=list(mesh.rank_list), mesh_dim_names=names
    )


def tensor_parallel_plan(
    text_model: Any, tp: int, *, moe_expert_parallel: bool = False
) -> dict[str, ParallelStyle]:
    """The TP style of every block of ``text_model`` (the module holding the decoder ``layers``),
    by module path; raises ``ValueError`` naming every block the plan cannot split at ``tp``.
    ``moe_expert_parallel``: check a model whose MoE blocks will be expert-parallel before tensor
    parallelism is applied (they stay whole over tp, so their sizes need not divide it)."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp={tp!r} must be a positive int")
    plan: dict[str, ParallelStyle] = {}
    errors: list[str] = []
    for i, block in enumerate(text_model.layers):
        kind, mixer = mixer_of(i, block)
        prefix = f"layers.{i}"
        error = _block_error(block, kind, mixer, tp, moe_expert_parallel)
        if error is not None:
            errors.append(f"layer {i}: {error}")
            continue
        plan[f"{prefix}.{kind}"] = (
            GatedDeltaNetTensorParallel() if kind == "linear_attn" else AttentionTensorParallel()
        )
        if getattr(block.mlp, EP_RECORD, None) is None:  # an expert-parallel block stays whole over tp
            plan[f"{prefix}.mlp"] = MoETensorParallel() if is_moe_block(block.mlp) else MLPTensorParallel()
    if errors:
        raise ValueError(f"tensor parallelism at tp={tp}: " + "; ".join(errors))
    return plan


def _block_error(
    block: nn.Module, kind: str, mixer: nn.Module, tp: int, moe_expert_parallel: bool = False
) -> str | None:
    if head_shard_of(mixer) is not None:
        return "tensor parallelism is already applied"
    if is_parallelized(mixer):
        return "context parallelism is applied: apply tensor parallelism first, then apply_context_parallel"
    for name, module in block.named_modules():
        wrapper = wrapper_of(module, copies=False)
        if wrapper is not None:
            return (
                f"{name} is wrapped by {wrapper}: tensor parallelism splits the weights of the modules "
                "it holds, which would bypass the wrapper (PEFT's adapters and modules_to_save are not "
                "supported under tensor parallelism)"
            )
    for name, p in block.named_parameters():
        top = name.split(".", 1)[0]
        if top not in (kind, "mlp") and p.dim() != 1:
            return f"{name} {tuple(p.shape)} is not a part the tensor-parallel plan covers (norms, the mixer, the mlp)"
    error = _gdn_error(mixer, tp) if kind == "linear_attn" else _attention_error(mixer, tp)
    mlp = getattr(block, "mlp", None)
    if error is None and (
        getattr(mlp, EP_RECORD, None) is not None or (moe_expert_parallel and is_moe_block(mlp))
    ):
        return None  # its experts are split over ep; every TP rank runs the block whole
    return error or _mlp_error(mlp, tp)


def _gdn_error(mixer: nn.Module, tp: int) -> str | None:
    try:
        dims = LayerDims.of(mixer)
    except ValueError as e:
        return str(e)
    if any(getattr(m, "bias", None) is not None for m in (mixer.in_proj_qkv, mixer.out_proj, mixer.conv1d)):
        return "a GDN layer with biases is not a part the tensor-parallel plan covers"
    error = tensor_parallel_head_error(dims, tp)
    return None if error is None else f"linear_attn: {error}"


def _attention_error(mixer: nn.Module, tp: int) -> str | None:
    needed = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm", "head_dim")
    heads = (
        module_adapter_for(mixer).attention_heads(mixer) if all(hasattr(mixer, n) for n in needed) else None
    )
    if heads is None:
        return f"self_attn ({type(mixer).__name__}) is not an attention layer the tensor-parallel plan covers"
    if mixer.o_proj.bias is not None:
        return "self_attn: o_proj has a bias; the row-parallel o_proj of the plan takes none"
    return attention_head_error(*heads, tp)


def _mlp_error(mlp: nn.Module | None, tp: int) -> str | None:
    if mlp is None:
        return "the block has no mlp"
    if is_moe_block(mlp):
        experts = mlp.experts
        sizes = {
            "moe_intermediate_size": experts.gate_up_proj.shape[1] // 2,
            "shared_expert_intermediate_size": mlp.shared_expert.gate_proj.weight.shape[0],
        }
        act = getattr(mlp.shared_expert, "act_fn", None)
        swiglu_parts = (experts, mlp.shared_expert)
    elif all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
        sizes = {"intermediate_size": mlp.gate_proj.weight.shape[0]}
        act = getattr(mlp, "act_fn", None)
        swiglu_parts = (mlp,)
    else:
        return f"mlp ({type(mlp).__name__}) is not a SwiGLU MLP or MoE block the tensor-parallel plan covers"
    if act is not None and not is_silu(act):
        return f"mlp: activation {type(act).__name__} is not the SiLU of the SwiGLU the plan covers"
    for part in swiglu_parts:
        for name in ("gate_proj", "up_proj", "down_proj"):
            if getattr(getattr(part, name, None), "bias", None) is not None:
                return f"mlp: {name} has a bias; the plan covers SwiGLU MLPs without biases"
    for name, size in sizes.items():
        if size % tp:
            return f"mlp: {name}={size} is not divisible by tp={tp}"
    return None


def canonical_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The whole parameters and buffers of a tensor-parallel ``model`` (every rank; collective),
    with the fused projections back in transformers' row order: what a single-device model loads."""
    reorder = _reorders(model)
    return {name: _canonical(value, reorder) for name, value in model.state_dict(keep_vars=True).items()}


def canonical_grads(model: Any, grads: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """The whole gradient of every parameter of a tensor-parallel ``model`` that has one, in the
    single-device model's layout (collective, as :func:`canonical_state_dict`); ``grads``: the
    gradients by parameter name (``torch.autograd.grad``'s) instead of the parameters' ``.grad``."""
    reorder = _reorders(model)
    found = {name: p.grad if grads is None else grads.get(name) for name, p in model.named_parameters()}
    return {
        name: _canonical(found[name], reorder, key=id(p))
        for name, p in model.named_parameters()
        if found[name] is not None
    }


def _canonical(
    value: Any, reorder: dict[int, tuple[int, torch.Tensor]], *, key: int | None = None
) -> torch.Tensor:
    whole = value.full_tensor() if isinstance(value, DTensor) else value
    dim_inverse = reorder.get(id(value) if key is None else key)
    if dim_inverse is not None:
        dim, inverse = dim_inverse
        whole = whole.index_select(dim, inverse.to(whole.device))
    return whole.detach()


def _reorders(model: Any) -> dict[int, tuple[int, torch.Tensor]]:
    """By parameter id: (dim, index) that puts a fused projection's rows back in canonical order."""
    reorder: dict[int, tuple[int, torch.Tensor]] = {}
    for module in model.modules():
        shard = head_shard_of(module)
        if shard is not None and shard.kind == "gdn":
            order = qkv_grouped_order(*shard.sizes)
            for p in (module.in_proj_qkv.weight, module.conv1d.weight):
                reorder[id(p)] = (0, torch.as_tensor(np.argsort(order)))
        elif shard is not None and shard.kind == "moe":
            order = gate_up_interleaved_order(*shard.sizes)
            reorder[id(module.experts.gate_up_proj)] = (1, torch.as_tensor(np.argsort(order)))
    return reorder
