"""The fused-attention kernel interface a platform may offer (:meth:`TensorOps.attention_kernel`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

Tensor = Any  # a torch.Tensor or a mindspore.Tensor, depending on the platform

__all__ = ["AttentionKernel"]


class AttentionKernel(ABC):
    """A fused softmax-attention kernel that returns its log-sum-exp, on one rectangle of queries
    and keys with no mask: every query sees every key, or (``causal``, Tq = Tk) query i sees keys
    0..i. Scores are ``scale * q k^T``; key/value head j serves query heads ``j*G .. j*G+G-1``.

    q ``[B, H, Tq, D]``, k and v ``[B, Hkv, Tk, D]``; lse ``[B, H, Tq]`` (fp32, fp64 for fp64).
    :mod:`hyperpar_gdn.ops.attention.softmax` merges rectangles through their log-sum-exp and calls
    :meth:`backward` per rectangle with the merged output and log-sum-exp, which gives that
    rectangle's exact share of the gradients."""

    name: str

    @abstractmethod
    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor]:
        """-> (o ``[B, H, Tq, D]`` in q's dtype, lse ``[B, H, Tq]``); autograd off."""

    @abstractmethod
    def backward(
        self,
        do: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        o: Tensor,
        lse: Tensor,
        *,
        causal: bool,
        scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """-> (dq, dk, dv) of the rectangle, with ``o`` and ``lse`` those of the whole row (every
        rectangle of these queries merged)."""
