"""The chain of fragments a state crosses, in global order, for the state modes (p2p, all_gather,
scan): which rank holds each fragment of the sequence, and where this rank's fragments sit in it.

Summaries travel as ``[n*B, ...]``: this rank's n fragments stacked slot-major along the batch
dim (n = 1 for contiguous shards, 2 for the head_tail layout).
"""

from __future__ import annotations

from dataclasses import dataclass

from hyperpar_gdn.distributed.cp.common import CPGroup
from hyperpar_gdn.distributed.layout import TokenLayout
from hyperpar_gdn.platform import Tensor


def split_fragments(xp, x: Tensor, n: int) -> list[Tensor]:
    """x ``[n*B, ...]`` -> the n fragments' ``[B, ...]`` (x itself when n = 1)."""
    return [x] if n == 1 else xp.split(x, [x.shape[0] // n] * n, 0)


@dataclass(frozen=True)
class Chain:
    """The fragments of the sequence in global order, as ``(rank, slot)``, and the global indices
    of this rank's fragments in slot order (:class:`~hyperpar_gdn.distributed.layout.TokenLayout`;
    contiguous: fragment r is rank r's only one)."""

    order: tuple[tuple[int, int], ...]
    mine: tuple[int, ...]

    @classmethod
    def of(cls, cp: CPGroup, layout: TokenLayout | None) -> Chain:
        if layout is None:
            return cls(order=tuple((r, 0) for r in range(cp.size)), mine=(cp.rank,))
        order = tuple((f.rank, f.slot) for f in layout.fragments)
        return cls(order=order, mine=tuple(order.index((cp.rank, f.slot)) for f in layout.mine(cp.rank)))

    def previous(self, i: int) -> tuple[int, int] | None:
        return self.order[i - 1] if i > 0 else None

    def next(self, i: int) -> tuple[int, int] | None:
        return self.order[i + 1] if i + 1 < len(self.order) else None
