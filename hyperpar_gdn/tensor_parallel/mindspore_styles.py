"""Tensor parallelism on MindSpore: the GDN layer, the softmax attention, the SwiGLU MLP and the
MoE block split by heads (or columns) over a TP group, through the platform's collectives.

The split is torch's (:mod:`.styles`, docs/tensor_parallel.md), on the MindSpore cells of
:mod:`hyperpar_gdn.models.mindspore`, by the rules of :mod:`hyperpar_gdn.planning.tp_rules`. TP
rank t of tp:

- GDN: q/k heads ``[t hk, (t+1) hk)`` (hk = num_k_heads / tp) with their value heads ``[t hv,
  (t+1) hv)``: the ``in_proj_qkv`` and ``conv1d`` rows of those q, k and v heads, ``in_proj_z``,
  ``in_proj_a``, ``in_proj_b``, ``A_log``, ``dt_bias`` by value head, ``out_proj`` by input
  columns; the gated norm's weight whole (its gradient summed over tp). The local rows are kept
  in the order a one-device layer of hk and hv heads has (``[q | k | v]``), so the layer's own
  forward, and a context-parallel style's, run on them unchanged.
- attention: query heads ``[t h, (t+1) h)`` (h = heads / tp): ``q_proj`` rows (query and output
  gate of each head), ``o_proj`` input columns; ``k_proj``/``v_proj`` by K/V head when tp divides
  them, else whole on every rank, each using the one K/V head of its query heads (gradient summed
  over tp); ``q_norm``/``k_norm`` whole (gradients summed).
- MLP: ``gate_proj``, ``up_proj`` rows, ``down_proj`` input columns; MoE: every routed expert and
  the shared expert so, the router and the shared expert's gate whole (gradients summed).

Each block takes the same input on every TP rank and returns the sum of the ranks' parts (one
all-reduce over the TP group); in the backward its input's gradient is summed likewise. Both go
through forward hooks, which stay in place when a context-parallel style later replaces
``construct``: apply tensor parallelism first, then context parallelism over the cp axis of a
``(cp, tp)`` (or ``(dp, cp, tp)``) mesh, tp innermost.

No communication in :meth:`TensorParallel.apply`: each rank cuts its part from the whole weights
it holds (the same on every rank). :mod:`.mindspore_apply` applies the styles to a whole model
and puts the parts back together in the one-device layout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Parameter, nn, ops

from hyperpar_gdn.distributed.parallel_style import is_parallelized
from hyperpar_gdn.models.mindspore.moe import expert_weights
from hyperpar_gdn.ops.blocks import rms_norm, sparse_moe
from hyperpar_gdn.ops.gdn.layer import LayerDims, LayerWeights
from hyperpar_gdn.ops.head_shard import HeadShard, head_shard_of, set_head_shard
from hyperpar_gdn.ops.projections import WeightLinear
from hyperpar_gdn.planning.tp_rules import (
    Parts,
    attention_head_error,
    attention_parts,
    gdn_parts,
    kv_head_of,
    kv_heads_per_rank,
    mlp_parts,
    span,
    tensor_parallel_head_error,
)
from hyperpar_gdn.platform import ops_for

__all__ = [
    "AttentionTensorParallel",
    "GatedDeltaNetTensorParallel",
    "MLPTensorParallel",
    "MoETensorParallel",
    "TensorParallel",
]


class _SumGradOverTP(nn.Cell):
    """Identity; the backward sums the gradient over the TP group (a block's input, a weight every
    TP rank holds whole but uses for its own heads only)."""

    def __init__(self, comm: Any, group: Any) -> None:
        super().__init__(auto_prefix=False)
        self._comm, self._group = comm, group

    def construct(self, x: ms.Tensor) -> ms.Tensor:
        return x.copy()

    def bprop(self, x: ms.Tensor, out: ms.Tensor, dout: ms.Tensor) -> tuple[ms.Tensor]:
        return (self._comm.all_reduce_sum(dout, self._group),)


class _ReduceFromTP(nn.Cell):
    """The ranks' partial outputs summed over the TP group (in group rank order: the same sum on
    every rank); the gradient passes unchanged."""

    def __init__(self, comm: Any, group: Any) -> None:
        super().__init__(auto_prefix=False)
        self._comm, self._group = comm, group

    def construct(self, x: ms.Tensor) -> ms.Tensor:
        return self._comm.all_reduce_sum(x, self._group)

    def bprop(self, x: ms.Tensor, out: ms.Tensor, dout: ms.Tensor) -> tuple[ms.Tensor]:
        return (dout,)


def _owner(cell: nn.Cell, name: str) -> tuple[nn.Cell, str]:
    """(the cell holding parameter ``name`` of ``cell``, its attribute name there)."""
    *path, leaf = name.split(".")
    for part in path:
        cell = getattr(cell, part)
    return cell, leaf


def _param(cell: nn.Cell, name: str) -> Parameter:
    return getattr(*_owner(cell, name))


def _cut(cell: nn.Cell, parts: Parts) -> None:
    """Replace each parameter of ``parts`` by its rows (or columns) given there: no communication."""
    for name, (dim, index) in parts.items():
        owner, leaf = _owner(cell, name)
        old = getattr(owner, leaf)
        local = ops.gather(old.value(), ms.Tensor(index.astype(np.int64)), dim)
        setattr(owner, leaf, Parameter(local, name=old.name, requires_grad=old.requires_grad))


class TensorParallel:
    """Base of the MindSpore TP styles: ``apply(cell, tp_mesh)`` checks, then splits ``cell`` in
    place over the 1-D TP mesh (e.g. ``init_device_mesh("cpu", (cp, tp), mesh_dim_names=("cp",
    "tp"))["tp"]``) and returns it. A wrong set-up raises one ``ValueError`` on every rank before
    anything changes (the checks read only the cell and the mesh size: no communication). The
    split cell's :class:`~hyperpar_gdn.ops.head_shard.HeadShard` records its whole sizes, each
    rank's parts and the whole shapes of the split parameters."""

    kind = ""  # the HeadShard's kind

    def apply(self, cell: nn.Cell, tp_mesh: Any) -> nn.Cell:
        if tp_mesh.ndim != 1:
            raise ValueError(
                f"tensor parallelism needs a 1-D mesh; got shape {tp_mesh.shape}: pass mesh['tp']"
            )
        tp, rank = tp_mesh.size(), tp_mesh.get_local_rank()
        error = self.refusal(cell, tp)
        if error is not None:
            raise ValueError(error)
        sizes, parts = self.split(cell, tp)
        shapes = {n: tuple(_param(cell, n).shape) for n in parts(0)}
        _cut(cell, parts(rank))
        comm, group = tp_mesh.platform.collectives, tp_mesh.get_group()
        weights = self.localize(cell, tp, rank, _SumGradOverTP(comm, group))
        reduce = _ReduceFromTP(comm, group)
        shard = HeadShard(self.kind, tp, rank, group, sizes, reduce, weights, shapes, parts)
        set_head_shard(cell, shard)
        _block_hooks(cell, _SumGradOverTP(comm, group), reduce)
        return cell

    def refusal(self, cell: nn.Cell, tp: int) -> str | None:
        """Why ``cell`` cannot be split over tp ranks (naming the cell and tp), or None."""
        if head_shard_of(cell) is not None:
            error = "tensor parallelism is already applied"
        elif is_parallelized(cell):
            error = "context parallelism is applied: apply tensor parallelism first, then context parallelism"
        else:
            error = self.error(cell, tp)
        return None if error is None else f"{type(cell).__name__} at tp={tp}: {error}"

    def error(self, cell: nn.Cell, tp: int) -> str | None:
        """Why ``cell`` (not split yet) cannot be split over tp ranks, or None."""
        raise NotImplementedError

    def split(self, cell: nn.Cell, tp: int) -> tuple[tuple[int, ...], Callable[[int], Parts]]:
        """(the whole sizes the rules read, the parts of every rank), read from ``cell`` before the cut."""
        raise NotImplementedError

    def localize(self, cell: nn.Cell, tp: int, rank: int, sum_grad: nn.Cell) -> Callable[[], Any] | None:
        """After the cut: the cell's head counts become the local ones, and the weights it holds
        whole go through ``sum_grad`` where the forward uses them; returns the local weights as
        the forward reads them (:attr:`HeadShard.weights`), or None."""
        return None


def _block_hooks(cell: nn.Cell, copy_in: nn.Cell, reduce_out: nn.Cell) -> None:
    """The block's input through ``copy_in`` (its gradient summed over tp) and its output through
    ``reduce_out`` (summed over tp); a prefill's record (a decoding state of local heads) refused."""

    def pre(_cell: nn.Cell, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if kwargs.get("prefill_states") is not None:
            raise NotImplementedError(
                f"{type(cell).__name__} under tensor parallelism does not record prefill states"
            )
        if args:
            return (copy_in(args[0]), *args[1:]), kwargs
        for name in ("hidden_states", "x"):
            if name in kwargs:
                return args, {**kwargs, name: copy_in(kwargs[name])}
        raise TypeError(f"a tensor-parallel {type(cell).__name__} got no input (hidden_states)")

    def post(_cell: nn.Cell, args: tuple, kwargs: dict, output: Any) -> Any:
        return reduce_out(output)

    cell.register_forward_pre_hook(pre, with_kwargs=True)
    cell.register_forward_hook(post, with_kwargs=True)


class GatedDeltaNetTensorParallel(TensorParallel):
    """The MindSpore GDN layer split by q/k heads with their value heads (module docstring)."""

    kind = "gdn"

    def error(self, cell: nn.Cell, tp: int) -> str | None:
        dims = LayerDims.of(cell)
        return tensor_parallel_head_error(dims, tp)

    def split(self, cell: nn.Cell, tp: int) -> tuple[tuple[int, ...], Callable[[int], Parts]]:
        dims = LayerDims.of(cell)

        def parts(rank: int) -> Parts:
            return gdn_parts(dims, tp, rank)

        return (dims.num_k_heads, dims.head_k_dim, dims.num_v_heads, dims.head_v_dim), parts

    def localize(self, cell: nn.Cell, tp: int, rank: int, sum_grad: nn.Cell) -> Callable[[], Any] | None:
        dims = LayerDims.of(cell)
        hk, hv = dims.num_k_heads // tp, dims.num_v_heads // tp
        cell.num_k_heads, cell.num_v_heads = hk, hv
        cell.key_dim, cell.value_dim = hk * dims.head_k_dim, hv * dims.head_v_dim
        cell.conv_dim = 2 * cell.key_dim + cell.value_dim

        def weights() -> LayerWeights:
            return LayerWeights(
                qkv=WeightLinear(cell.in_proj_qkv.weight),
                z=WeightLinear(cell.in_proj_z.weight),
                b=WeightLinear(cell.in_proj_b.weight),
                a=WeightLinear(cell.in_proj_a.weight),
                conv=cell.conv1d.weight,
                a_log=cell.A_log,
                dt_bias=cell.dt_bias,
                norm=sum_grad(cell.norm.weight),
                out=WeightLinear(cell.out_proj.weight),
            )

        return weights


class AttentionTensorParallel(TensorParallel):
    """The MindSpore ``CausalSelfAttention`` split by query heads (module docstring)."""

    kind = "attention"

    def error(self, cell: nn.Cell, tp: int) -> str | None:
        missing = [
            n for n in ("projection_weights", "q_norm", "k_norm", "num_kv_heads") if not hasattr(cell, n)
        ]
        if missing:
            return f"not the MindSpore CausalSelfAttention the plan covers: it lacks {', '.join(missing)}"
        return attention_head_error(int(cell.num_heads), int(cell.num_kv_heads), tp)

    def split(self, cell: nn.Cell, tp: int) -> tuple[tuple[int, ...], Callable[[int], Parts]]:
        heads, kv_heads, d = int(cell.num_heads), int(cell.num_kv_heads), int(cell.head_dim)

        def parts(rank: int) -> Parts:
            return attention_parts(heads, kv_heads, d, tp, rank)

        return (heads, kv_heads), parts

    def localize(self, cell: nn.Cell, tp: int, rank: int, sum_grad: nn.Cell) -> Callable[[], Any] | None:
        heads, kv_heads, d = int(cell.num_heads), int(cell.num_kv_heads), int(cell.head_dim)
        head = kv_head_of(rank, kv_heads, tp)  # tp a multiple of the K/V heads: the one this rank uses
        rows = None if head is None else span(head, 1, d)
        cell.num_heads, cell.num_kv_heads = heads // tp, kv_heads_per_rank(kv_heads, tp)
        for norm in (cell.q_norm, cell.k_norm):
            norm.construct = _norm_with_summed_grad(norm, sum_grad)

        def weights() -> tuple[ms.Tensor, ms.Tensor, ms.Tensor, ms.Tensor]:
            k, v = cell.k_proj.weight, cell.v_proj.weight
            if rows is not None:
                index = ms.Tensor(rows.astype(np.int64))
                k, v = (ops.gather(sum_grad(w), index, 0) for w in (k, v))
            return cell.q_proj.weight, k, v, cell.o_proj.weight

        return weights


def _norm_with_summed_grad(norm: nn.Cell, sum_grad: nn.Cell) -> Callable[[ms.Tensor], ms.Tensor]:
    """The RMSNorm's forward on its weight passed through ``sum_grad``."""

    def construct(x: ms.Tensor) -> ms.Tensor:
        return rms_norm(ops_for(x), x, sum_grad(norm.weight), norm.eps, zero_centred=norm.zero_centred)

    return construct


class MLPTensorParallel(TensorParallel):
    """The MindSpore SwiGLU MLP split by columns: ``gate_proj``, ``up_proj`` rows, ``down_proj``
    input columns."""

    kind = "mlp"

    def error(self, cell: nn.Cell, tp: int) -> str | None:
        size = int(cell.gate_proj.weight.shape[0])
        return None if size % tp == 0 else f"mlp: intermediate_size={size} is not divisible by tp={tp}"

    def split(self, cell: nn.Cell, tp: int) -> tuple[tuple[int, ...], Callable[[int], Parts]]:
        intermediate = int(cell.gate_proj.weight.shape[0])

        def parts(rank: int) -> Parts:
            return mlp_parts(intermediate, tp, rank)

        return (intermediate,), parts


class MoETensorParallel(TensorParallel):
    """The MindSpore ``SparseMoeBlock`` split by columns: every routed expert and the shared expert
    as :class:`MLPTensorParallel` splits an MLP; the router and the shared expert's gate whole on
    every rank (the same routing everywhere), their gradients summed over tp."""

    kind = "moe"

    def error(self, cell: nn.Cell, tp: int) -> str | None:
        sizes = {
            "moe_intermediate_size": int(cell.experts[0].gate_proj.weight.shape[0]),
            "shared_expert_intermediate_size": int(cell.shared_expert.gate_proj.weight.shape[0]),
        }
        bad = [f"{name}={size}" for name, size in sizes.items() if size % tp]
        return f"mlp: {', '.join(bad)} not divisible by tp={tp}" if bad else None

    def split(self, cell: nn.Cell, tp: int) -> tuple[tuple[int, ...], Callable[[int], Parts]]:
        mlps = {f"experts.{e}": MLPTensorParallel().split(x, tp)[1] for e, x in enumerate(cell.experts)}
        mlps["shared_expert"] = MLPTensorParallel().split(cell.shared_expert, tp)[1]

        def parts(rank: int) -> Parts:
            return {f"{prefix}.{n}": part for prefix, of in mlps.items() for n, part in of(rank).items()}

        return (int(cell.experts[0].gate_proj.weight.shape[0]),), parts

    def localize(self, cell: nn.Cell, tp: int, rank: int, sum_grad: nn.Cell) -> Callable[[], Any] | None:
        def construct(x: ms.Tensor) -> ms.Tensor:
            return sparse_moe(
                ops_for(x),
                x,
                router=sum_grad(cell.gate.weight),
                experts=[expert_weights(expert) for expert in cell.experts],
                top_k=cell.top_k,
                shared=expert_weights(cell.shared_expert),
                shared_gate=sum_grad(cell.shared_expert_gate.weight),
            )

        cell.construct = construct
        return None
