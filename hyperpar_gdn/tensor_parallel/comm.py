"""The exchanges of tensor parallelism (torch): a block's input and output, and the gradients of
the parameters every TP rank holds whole.

A tensor-parallel block (a token mixer, an MLP, an MoE block) takes the same input ``x`` on every
TP rank, computes with its rank's heads or columns only, and returns the sum over the TP ranks:

- :func:`copy_to_tp` on its input: identity forward; backward, the input's gradient (each rank
  holds its heads' share) summed over the TP group (one all-reduce of ``[B, T, hidden]``).
- :func:`reduce_from_tp` on its output: the partial outputs summed over the TP group (one
  all-reduce of ``[B, T, hidden]``); backward, identity.
- :func:`sum_grad_over_tp`: a parameter that every TP rank holds whole but uses for its own heads
  only (the gated norm's weight, the q/k norms, the MoE router, K/V projections replicated when
  tp exceeds the K/V heads) is used through it: its gradient is summed over the TP group.

Every exchange is an all-reduce (sum) over the TP process group. :func:`count_tp_traffic` records
each one's kind and payload bytes (docs/tensor_parallel.md has the formula).

:func:`sync_tp_grads` sums a TP model's gradient shares over the CP axis and averages them over
DP without FSDP (each TP rank its own shard); :func:`clip_grad_norm_` is the whole model's gradient norm (and clipping) when the gradients are
TP shards beside whole tensors or FSDP shards on another mesh (torch's own needs one mesh).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = [
    "TPTraffic",
    "clip_grad_norm_",
    "copy_to_tp",
    "count_tp_traffic",
    "global_grad_norm",
    "reduce_from_tp",
    "sum_grad_over_tp",
    "sync_tp_grads",
]


@dataclass
class TPTraffic:
    """The all-reduces of tensor parallelism on this rank while :func:`count_tp_traffic` is open:
    ``calls`` (kind, payload bytes) in order; kinds: ``"input_grad"``, ``"output"``,
    ``"param_grad"``."""

    calls: list[tuple[str, int]] = field(default_factory=list)

    def bytes(self, kind: str | None = None) -> int:
        """Payload bytes of the calls of ``kind`` (all calls when None)."""
        return sum(n for k, n in self.calls if kind is None or k == kind)

    def count(self, kind: str | None = None) -> int:
        return sum(1 for k, _ in self.calls if kind is None or k == kind)


_LOG: list[TPTraffic] = []


@contextlib.contextmanager
def count_tp_traffic() -> Iterator[TPTraffic]:
    """Record every tensor-parallel all-reduce of this process inside the block (forward and
    backward run inside it)."""
    log = TPTraffic()
    _LOG.append(log)
    try:
        yield log
    finally:
        _LOG.remove(log)


def _all_reduce(x: torch.Tensor, group: Any, kind: str) -> torch.Tensor:
    out = x.contiguous().clone()
    for log in _LOG:
        log.calls.append((kind, out.numel() * out.element_size()))
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, kind: str) -> torch.Tensor:
        ctx.group, ctx.kind = group, kind
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_reduce(grad, ctx.group, ctx.kind), None, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        return _all_reduce(x, group, "output")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``x`` (the same on every TP rank) as a block's input: backward sums its gradient over ``group``."""
    return _CopyToTP.apply(x, group, "input_grad")


def reduce_from_tp(x: torch.Tensor, group: Any) -> torch.Tensor:
    """A block's partial output ``x`` summed over ``group`` (the gradient passes unchanged)."""
    return _ReduceFromTP.apply(x, group)


def sum_grad_over_tp(weight: torch.Tensor, group: Any) -> torch.Tensor:
    """``weight`` (whole on every TP rank, used for this rank's heads only) as the forward uses it:
    identity; backward, its gradient summed over ``group``. Applied where the weight is used, so
    it holds whatever holds the parameter (FSDP's unsharded copy, a recomputed forward)."""
    return _CopyToTP.apply(weight, group, "param_grad")


def global_grad_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Collective over every rank: the 2-norm of the whole gradient whose pieces are ``grads``
    (this rank's): ``DTensor`` shards on any meshes, or tensors every rank holds whole and equal.
    Each rank adds its pieces' squares weighted by (the tensor's distinct shards / the world size),
    so the ranks holding copies of one shard count it once in the sum."""
    world, device = dist.get_world_size(), grads[0].device
    # float64 for the sum, but float32 on NPUs (HCCL reduces fewer dtypes)
    total = torch.zeros((), dtype=torch.float32 if device.type == "npu" else torch.float64, device=device)
    for g in grads:
        shards = 1
        if hasattr(g, "to_local"):
            for axis, placement in enumerate(g.placements):
                if not placement.is_replicate():  # Shard, or FSDP's _StridedShard over TP's
                    shards *= g.device_mesh.size(axis)
            g = g.to_local()
        total += g.detach().to(total.dtype).square().sum() * (shards / world)
    dist.all_reduce(total)
    return total.sqrt()


def clip_grad_norm_(grads: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Collective: :func:`global_grad_norm` of ``grads`` (fp32), and, as torch's
    ``clip_grad_norm_``, every gradient scaled in place by ``min(1, max_norm / (norm + 1e-6))``
    (``max_norm`` 0 or inf: the norm only, the gradients untouched)."""
    if not grads:
        return torch.zeros(())
    norm = global_grad_norm(grads)
    if 0 < max_norm < float("inf"):
        coef = min(1.0, max_norm / (float(norm) + 1e-6))
        with torch.no_grad():
            for g in grads:
                _local(g).mul_(coef)
    return norm.float()


def sync_tp_grads(model: torch.nn.Module, mesh: Any) -> None:
    """Without FSDP: sum ``model``'s gradients over ``mesh["cp"]`` and average them over
    ``mesh["dp"]``, in place, each ``DTensor``'s local shard as the tensor it is (one flat
    all-reduce per dtype and axis; a parameter without a gradient counts as zeros). The gradients
    of the weights every TP rank holds whole are already summed over tp by the TP styles."""
    from hyperpar_gdn.distributed.grads import sync_context_parallel_grads

    params = [p for p in model.parameters() if p.requires_grad]
    local = [torch.zeros_like(_local(p)) if p.grad is None else _local(p.grad) for p in params]
    summed = sync_context_parallel_grads(local, mesh, dp_axis="dp")
    for p, g in zip(params, summed, strict=True):
        is_shard = isinstance(p, DTensor)
        p.grad = DTensor.from_local(g, p.device_mesh, p.placements, run_check=False) if is_shard else g


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
