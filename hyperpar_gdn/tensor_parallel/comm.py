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
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["TPTraffic", "copy_to_tp", "count_tp_traffic", "reduce_from_tp", "sum_grad_over_tp"]


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
