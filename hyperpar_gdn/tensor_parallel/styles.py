"""Tensor-parallel styles (torch's ``ParallelStyle``) for the blocks of Qwen3.5 models.

Each style splits one block's parameters by heads (a token mixer) or by columns (an MLP, the
experts) over a 1-D torch ``DeviceMesh`` of TP ranks, as ``DTensor`` parameters: column-parallel
weights ``Shard(0)``, row-parallel ones ``Shard(1)`` (the experts' ``Shard(1)`` and ``Shard(2)``);
parameters a rank needs whole stay plain tensors, used through :func:`~.comm.sum_grad_over_tp`
(their gradients are rank shares, summed over the TP group). The block then computes on its rank's local
shards (``DTensor.to_local()``: the gradients reach the DTensor parameters) and its output is
summed over the TP group (:func:`~.comm.reduce_from_tp`; its input's gradient by
:func:`~.comm.copy_to_tp`), through forward hooks that stay in place when a
context-parallel style later replaces the forward.

Which rows and heads each rank holds follows :mod:`hyperpar_gdn.planning.tp_rules`. Fused
projections split per segment, in a global row order that does not depend on tp:

- GDN ``in_proj_qkv`` and ``conv1d`` (rows ``[q | k | v]``): grouped by q/k head, head h's q rows,
  k rows and its value heads' v rows together (``qkv_grouped_order``), so ``Shard(0)`` gives
  each rank whole q/k heads with their value heads; the local rows are put back in ``[q | k | v]``
  order on each forward (an index over the local weight).
- the experts' ``gate_up_proj`` (``[E, 2I, C]``, gate rows then up rows): gate row u and up row u
  side by side (``gate_up_interleaved_order``).

A checkpoint of a TP model (``state_dict`` of DTensors) therefore holds these two or three
parameters in that order: :func:`~.apply.canonical_state_dict` gives transformers' order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from hyperpar_gdn.distributed.decoder_layers import module_adapter_for
from hyperpar_gdn.ops.blocks import swiglu
from hyperpar_gdn.ops.gdn.layer import LayerDims, LayerWeights
from hyperpar_gdn.ops.head_shard import HeadShard, set_head_shard
from hyperpar_gdn.ops.projections import WeightLinear
from hyperpar_gdn.planning.tp_rules import (
    gate_up_interleaved_order,
    gate_up_local_order,
    kv_head_of,
    qkv_grouped_order,
    qkv_local_order,
)
from hyperpar_gdn.platform import ops_for
from hyperpar_gdn.tensor_parallel.comm import copy_to_tp, reduce_from_tp, sum_grad_over_tp

__all__ = [
    "AttentionTensorParallel",
    "GatedDeltaNetTensorParallel",
    "MLPTensorParallel",
    "MoETensorParallel",
    "local",
]


def local(p: Any) -> Any:
    """This rank's shard of a DTensor parameter (differentiable), or a plain tensor as it is."""
    return p.to_local() if isinstance(p, DTensor) else p


def _shard(module: nn.Module, name: str, mesh: Any, dim: int, order: np.ndarray | None = None) -> None:
    """Replace parameter ``name`` of ``module`` by a DTensor ``Shard(dim)`` of it (rows reordered
    by ``order`` first), cut from the whole tensor every rank holds: no communication."""
    p = module._parameters[name]
    full = p.detach()
    if order is not None:
        full = full.index_select(dim, torch.as_tensor(order, device=full.device))
    size, rank = mesh.size(), mesh.get_local_rank()
    n = full.shape[dim] // size
    piece = full.narrow(dim, rank * n, n).clone()
    dt = DTensor.from_local(piece, mesh, [Shard(dim)], run_check=False)
    module._parameters[name] = nn.Parameter(dt, requires_grad=p.requires_grad)


def _local_linear(linear: nn.Module, mesh: Any, dim: int) -> None:
    """A Linear whose weight is split on ``dim`` (0: column-parallel, with its bias; 1: row-parallel,
    no bias) that computes on its local shard, without communication."""
    _shard(linear, "weight", mesh, dim)
    if linear.bias is not None:
        _shard(linear, "bias", mesh, 0)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, local(linear.weight), None if linear.bias is None else local(linear.bias))

    linear.forward = forward


def _rows_linear(linear: nn.Module, rows: slice, group: Any) -> None:
    """A Linear every TP rank holds whole but uses rows ``rows`` of (K/V heads replicated when tp
    exceeds them); its gradient is summed over the TP group."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        weight = sum_grad_over_tp(linear.weight, group)[rows]
        bias = None if linear.bias is None else sum_grad_over_tp(linear.bias, group)[rows]
        return F.linear(x, weight, bias)

    linear.forward = forward


def _whole_with_summed_grads(module: nn.Module, group: Any) -> None:
    """A module every TP rank holds whole (a norm over the head dim, the MoE router, the shared
    expert's gate) whose gradients are rank shares: its forward runs on its parameters passed
    through :func:`sum_grad_over_tp`, put in place of the parameters for the call."""
    original = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        held = dict(module._parameters)
        try:
            for name, p in held.items():
                if p is not None:
                    module._parameters[name] = sum_grad_over_tp(p, group)
            return original(*args, **kwargs)
        finally:
            module._parameters.update(held)

    module.forward = forward


def _first_arg(names: Sequence[str]) -> Callable:
    def pre_hook(args: tuple, kwargs: dict, fn: Callable) -> tuple[tuple, dict]:
        if args:
            return (fn(args[0]), *args[1:]), kwargs
        for name in names:
            if name in kwargs:
                return args, {**kwargs, name: fn(kwargs[name])}
        raise TypeError(f"a tensor-parallel block got no input among {list(names)}")

    return pre_hook


def _record(
    module: nn.Module, kind: str, mesh: Any, sizes: tuple[int, ...], weights: Callable | None = None
) -> None:
    """Record the block's :class:`HeadShard` (its whole ``sizes``, the TP group of ``mesh``)."""
    group = mesh.get_group()
    shard = HeadShard(
        kind=kind,
        size=mesh.size(),
        rank=mesh.get_local_rank(),
        group=group,
        sizes=sizes,
        reduce=partial(reduce_from_tp, group=group),
        weights=weights,
    )
    set_head_shard(module, shard)


def _block_hooks(module: nn.Module, group: Any, input_names: Sequence[str]) -> None:
    """Sum the block's output over the TP group (and its input's gradient). A prefill's record
    passes to the block: a token mixer keeps the decoding state of its local heads."""
    rewrite = _first_arg(input_names)

    def pre(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return rewrite(args, kwargs, lambda x: copy_to_tp(x, group))

    def post(mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if isinstance(output, tuple):
            return (reduce_from_tp(output[0], group), *output[1:])
        return reduce_from_tp(output, group)

    module.register_forward_pre_hook(pre, with_kwargs=True)
    module.register_forward_hook(post, with_kwargs=True)


class GatedDeltaNetTensorParallel(ParallelStyle):
    """A GDN layer split by q/k heads with their value heads: ``in_proj_qkv`` and ``conv1d`` (grouped
    rows, ``qkv_grouped_order``), ``in_proj_z``, ``in_proj_a``, ``in_proj_b``, ``A_log``,
    ``dt_bias`` ``Shard(0)``; ``out_proj`` ``Shard(1)``; the gated norm's weight (shared by the
    heads) whole, its gradient summed. The layer's head counts become the local ones
    (``num_k_heads / tp``, ``num_v_heads / tp``) and its weights the local shards
    (:meth:`LayerWeights.of`), so its forward (and a context-parallel style's) runs on them; a
    model family whose layer's forward reads its whole weights gives the forward on the local
    ones (:meth:`~hyperpar_gdn.distributed.adapters.ModelAdapter.head_sharded_gdn_forward`)."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        dims, tp = LayerDims.of(module), device_mesh.size()
        group = device_mesh.get_group()
        hk, hv = dims.num_k_heads // tp, dims.num_v_heads // tp
        order = qkv_grouped_order(dims.num_k_heads, dims.head_k_dim, dims.num_v_heads, dims.head_v_dim)
        _shard(module.in_proj_qkv, "weight", device_mesh, 0, order)
        _shard(module.conv1d, "weight", device_mesh, 0, order)
        for linear in (module.in_proj_z, module.in_proj_b, module.in_proj_a):
            _shard(linear, "weight", device_mesh, 0)
        _shard(module, "A_log", device_mesh, 0)
        _shard(module, "dt_bias", device_mesh, 0)
        _shard(module.out_proj, "weight", device_mesh, 1)
        canonical = torch.as_tensor(  # on the weights' device once, not copied every forward
            qkv_local_order(dims, tp), device=module.A_log.device
        )

        def weights() -> LayerWeights:
            rows = canonical.to(module.A_log.device)
            return LayerWeights(
                qkv=WeightLinear(local(module.in_proj_qkv.weight).index_select(0, rows)),
                z=WeightLinear(local(module.in_proj_z.weight)),
                b=WeightLinear(local(module.in_proj_b.weight)),
                a=WeightLinear(local(module.in_proj_a.weight)),
                conv=local(module.conv1d.weight).index_select(0, rows),
                a_log=local(module.A_log),
                dt_bias=local(module.dt_bias),
                norm=sum_grad_over_tp(module.norm.weight, group),
                out=WeightLinear(local(module.out_proj.weight)),
            )

        sizes = (dims.num_k_heads, dims.head_k_dim, dims.num_v_heads, dims.head_v_dim)
        _record(module, "gdn", device_mesh, sizes, weights)
        module.num_k_heads, module.num_v_heads = hk, hv
        module.key_dim, module.value_dim = hk * dims.head_k_dim, hv * dims.head_v_dim
        module.conv_dim = 2 * module.key_dim + module.value_dim
        forward = module_adapter_for(module).head_sharded_gdn_forward(module)
        if forward is not None:
            module.forward = forward
        _block_hooks(module, group, ("hidden_states",))
        return module


class AttentionTensorParallel(ParallelStyle):
    """Softmax attention split by query heads: ``q_proj`` (query and output gate, per head)
    ``Shard(0)``, ``o_proj`` ``Shard(1)``; ``k_proj``/``v_proj`` ``Shard(0)`` when tp divides the
    K/V heads, else whole on every rank, each using the one K/V head of its query heads (gradient
    summed); ``q_norm``/``k_norm`` whole, gradients summed."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        tp, rank, group = device_mesh.size(), device_mesh.get_local_rank(), device_mesh.get_group()
        adapter = module_adapter_for(module)
        heads, kv_heads = adapter.attention_heads(module)
        _local_linear(module.q_proj, device_mesh, 0)
        if kv_heads % tp == 0:
            local_kv = kv_heads // tp
            _local_linear(module.k_proj, device_mesh, 0)
            _local_linear(module.v_proj, device_mesh, 0)
        else:  # tp is a multiple of kv_heads: every rank uses the one K/V head of its query heads
            local_kv, d = 1, module.head_dim
            head = kv_head_of(rank, kv_heads, tp)
            _rows_linear(module.k_proj, slice(head * d, (head + 1) * d), group)
            _rows_linear(module.v_proj, slice(head * d, (head + 1) * d), group)
        _local_linear(module.o_proj, device_mesh, 1)
        _whole_with_summed_grads(module.q_norm, group)
        _whole_with_summed_grads(module.k_norm, group)
        _record(module, "attention", device_mesh, (heads, kv_heads))
        adapter.set_local_attention_heads(module, heads // tp, local_kv)
        _block_hooks(module, group, ("hidden_states",))
        return module


def _local_swiglu(module: nn.Module, device_mesh: Any) -> None:
    """``gate_proj``/``up_proj`` ``Shard(0)``, ``down_proj`` ``Shard(1)``; the forward on the local
    columns gives this rank's share of the output."""
    for linear, dim in ((module.gate_proj, 0), (module.up_proj, 0), (module.down_proj, 1)):
        _shard(linear, "weight", device_mesh, dim)

    def forward(x: torch.Tensor) -> torch.Tensor:
        weights = (
            local(module.gate_proj.weight),
            local(module.up_proj.weight),
            local(module.down_proj.weight),
        )
        return swiglu(ops_for(x), x, *weights)

    module.forward = forward


class MLPTensorParallel(ParallelStyle):
    """A SwiGLU MLP split by columns: ``gate_proj``, ``up_proj`` ``Shard(0)``, ``down_proj``
    ``Shard(1)``; the output summed over the TP group."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        _record(module, "mlp", device_mesh, (int(module.gate_proj.weight.shape[0]),))
        _local_swiglu(module, device_mesh)
        _block_hooks(module, device_mesh.get_group(), ("x", "hidden_states"))
        return module


class MoETensorParallel(ParallelStyle):
    """transformers' Qwen3.5 sparse MoE block: every expert split by columns (``gate_up_proj``
    ``Shard(1)`` in interleaved rows, ``down_proj`` ``Shard(2)``), the shared expert as an MLP; the
    router and the shared expert's gate whole on every rank (the same routing everywhere), their
    gradients summed; the block's output summed over the TP group."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        group, experts = device_mesh.get_group(), module.experts
        intermediate = experts.gate_up_proj.shape[1] // 2
        _whole_with_summed_grads(module.gate, group)
        _whole_with_summed_grads(module.shared_expert_gate, group)
        _local_swiglu(module.shared_expert, device_mesh)
        _shard(experts, "gate_up_proj", device_mesh, 1, gate_up_interleaved_order(intermediate))
        _shard(experts, "down_proj", device_mesh, 2)
        canonical = torch.as_tensor(gate_up_local_order(intermediate, device_mesh.size()))
        experts.forward = _local_experts_forward(experts, canonical)
        _record(module, "moe", device_mesh, (int(intermediate),))
        _block_hooks(module, group, ("hidden_states",))
        return module


def _local_experts_forward(experts: nn.Module, canonical: torch.Tensor) -> Callable:
    """The routed experts on this rank's columns: for each expert some token chose, its tokens'
    SwiGLU output times their routing weight, added at their rows (a share of the output)."""

    def forward(
        hidden_NC: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        gate_up = local(experts.gate_up_proj)
        gate_up = gate_up.index_select(1, canonical.to(gate_up.device))  # [E, 2i, C]: gate rows, up rows
        down = local(experts.down_proj)  # [E, C, i]
        i = down.shape[-1]
        out = torch.zeros_like(hidden_NC)
        for e in torch.unique(top_k_index).tolist():  # the same experts on every TP rank
            tokens, slot = torch.nonzero(top_k_index == e, as_tuple=True)
            h = F.linear(hidden_NC[tokens], gate_up[e])
            y = F.linear(F.silu(h[:, :i]) * h[:, i:], down[e]) * top_k_weights[tokens, slot, None]
            out = out.index_add(0, tokens, y.to(out.dtype))
        return out

    return forward
