"""A block's share under tensor parallelism, as one typed record on either framework.

A tensor-parallel style (torch's :mod:`hyperpar_gdn.tensor_parallel.styles`, MindSpore's
:mod:`hyperpar_gdn.tensor_parallel.mindspore_styles`) splits a block (a token mixer by heads, an MLP
or MoE block by columns) and records what it did with :func:`set_head_shard`; everything that
needs to know (the GDN stages, which read the local weights; decoding, which sums a mixer's
share of the output itself; the TP plan's checks; the checkpoints' row orders) reads it with
:func:`head_shard_of`. Which heads and rows a rank holds follows
:mod:`hyperpar_gdn.planning.tp_rules`; this record only carries the result.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hyperpar_gdn.platform import Tensor

__all__ = ["BLOCK_KINDS", "HeadShard", "head_shard_of", "set_head_shard"]

BLOCK_KINDS = ("gdn", "attention", "mlp", "moe")

_ATTRIBUTE = "_hyperpar_head_shard"


@dataclass(frozen=True)
class HeadShard:
    """TP rank ``rank`` of ``size``'s share of one block.

    Attributes:
        kind: ``"gdn"``, ``"attention"``, ``"mlp"`` or ``"moe"``.
        size, rank: the TP group's size and this rank's index in it.
        group: the TP group (the framework's process group), over which the block's output is summed.
        sizes: the whole block's sizes the split rules read: gdn ``(Hk, Dk, H, Dv)`` (q/k heads,
            their dim, value heads, their dim); attention ``(heads, kv_heads)``; mlp and moe
            ``(intermediate,)`` (a MoE block's routed experts').
        reduce: a share of the block's output ``[B, T, hidden]`` -> the sum over the group (what
            the block's forward hook does; decoding calls a mixer's parts and sums it itself).
        weights: the local weights as the block's forward uses them (a GDN layer's
            :class:`~hyperpar_gdn.ops.gdn.layer.LayerWeights`; a MindSpore attention's q, k, v
            and o weights), or None where the forward reads its own parameters.
        shapes, parts: the whole shape of each split parameter, by name relative to the block,
            and ``parts(r)``: for each, ``(dim, global indices along it)`` that rank r holds
            (MindSpore's parameters are plain tensors: they are put back together from these;
            torch's are ``DTensor`` shards and leave both empty).
    """

    kind: str
    size: int
    rank: int
    group: Any
    sizes: tuple[int, ...]
    reduce: Callable[[Tensor], Tensor]
    weights: Callable[[], Any] | None = None
    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    parts: Callable[[int], Mapping[str, tuple[int, Any]]] | None = None

    def __post_init__(self) -> None:
        if self.kind not in BLOCK_KINDS:
            raise ValueError(f"kind={self.kind!r} is not one of {BLOCK_KINDS}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank={self.rank} is not a rank of a TP group of size={self.size}")

    def owned(self, total: int) -> range:
        """The global indices this rank holds of ``total`` heads (or columns) split evenly over
        the group: ``[rank * n, (rank + 1) * n)``, n = total / size."""
        if total % self.size:
            raise ValueError(f"{total} heads or columns do not split evenly over size={self.size}")
        n = total // self.size
        return range(self.rank * n, (self.rank + 1) * n)


def set_head_shard(module: Any, shard: HeadShard) -> None:
    """Record on ``module`` (a torch module or MindSpore cell) that it holds ``shard``; once."""
    if head_shard_of(module) is not None:
        raise ValueError(f"{type(module).__name__} already has tensor parallelism applied")
    setattr(module, _ATTRIBUTE, shard)


def head_shard_of(module: Any) -> HeadShard | None:
    """The share of a tensor-parallel block ``module`` holds (None: the block is whole)."""
    return getattr(module, _ATTRIBUTE, None)
