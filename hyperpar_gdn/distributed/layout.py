"""Which tokens of the sequence each context-parallel rank holds: the token layout.

- ``"contiguous"``: rank r holds one piece, tokens ``[r*T/cp, (r+1)*T/cp)`` (pieces may differ
  in length: rank r holds the r-th of them).
- ``"head_tail"`` (also called zigzag): the sequence is cut into 2*cp equal pieces of P = T/(2cp)
  tokens; rank r holds pieces r and 2cp-1-r, concatenated. Under causal softmax attention every
  rank then owns the same work (a head piece sees few keys, its tail piece many).

A rank's shard is its **fragments** (maximal runs of consecutive global positions) concatenated in
increasing global position. Every layer reads the layout from :class:`TokenLayout`: the GDN modes
run their chains over the fragments in global order (for head_tail: the head pieces of ranks
0..cp-1, then the tail pieces of ranks cp-1..0), the attention layers attend each fragment's
queries over the keys before its end.

Legend: T whole sequence, T_r rank r's shard, P a fragment's length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from hyperpar_gdn.planning.plan import check_layout
from hyperpar_gdn.platform import Tensor, TensorOps

__all__ = ["Fragment", "TokenLayout", "layout_error", "layout_mismatch"]


def layout_error(layout: str, seq_len: int, cp: int) -> str | None:
    """Why a whole sequence of ``seq_len`` tokens cannot be cut in ``layout`` over ``cp`` ranks."""
    pieces = 2 * cp if layout == "head_tail" else cp
    if seq_len % pieces:
        return (
            f"layout={layout!r} cuts the sequence into {pieces} equal pieces: T={seq_len} is not "
            f"divisible by {pieces}" + (f" (2*cp, cp={cp})" if layout == "head_tail" else f" (cp={cp})")
        )
    return None


@dataclass(frozen=True)
class Fragment:
    """A run of consecutive global positions held by one rank.

    Attributes:
        rank: the rank holding it.
        slot: its place among that rank's fragments (0 first).
        start: global position of its first token.
        length: its tokens.
        local_start: where it starts in its rank's shard.
    """

    rank: int
    slot: int
    start: int
    length: int
    local_start: int

    @property
    def stop(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class TokenLayout:
    """The layout ``kind`` of a sequence whose ranks hold ``lengths[r]`` tokens each.

    Build it with :meth:`of`, which checks the lengths (head_tail: every rank the same even
    number of tokens)."""

    kind: str
    lengths: tuple[int, ...]

    @classmethod
    def of(cls, kind: str, lengths: Sequence[int]) -> TokenLayout:
        check_layout(kind)
        lengths = tuple(int(t) for t in lengths)
        if kind == "head_tail" and (len(set(lengths)) > 1 or lengths[0] % 2):
            raise ValueError(
                f"layout='head_tail' needs every CP rank to hold two pieces of the same length (T divisible "
                f"by 2*cp); the ranks hold {list(lengths)} tokens"
            )
        return cls(kind=kind, lengths=lengths)

    @property
    def size(self) -> int:
        return len(self.lengths)

    @property
    def seq_len(self) -> int:
        return sum(self.lengths)

    @cached_property
    def fragments(self) -> tuple[Fragment, ...]:
        """Every fragment, in global order."""
        if self.kind == "contiguous" or self.size == 1:
            starts = np.concatenate([[0], np.cumsum(self.lengths)[:-1]])
            return tuple(
                Fragment(rank=r, slot=0, start=int(s), length=t, local_start=0)
                for r, (s, t) in enumerate(zip(starts, self.lengths, strict=True))
            )
        cp, piece = self.size, self.lengths[0] // 2
        heads = [Fragment(rank=r, slot=0, start=r * piece, length=piece, local_start=0) for r in range(cp)]
        tails = [
            Fragment(rank=r, slot=1, start=(2 * cp - 1 - r) * piece, length=piece, local_start=piece)
            for r in reversed(range(cp))
        ]
        return tuple(heads + tails)

    @property
    def is_contiguous(self) -> bool:
        """One fragment per rank, in rank order (rank-order concatenation is the sequence)."""
        return len(self.fragments) == self.size

    def mine(self, rank: int) -> tuple[Fragment, ...]:
        """Rank ``rank``'s fragments, in slot order (which is increasing global position)."""
        return tuple(sorted((f for f in self.fragments if f.rank == rank), key=lambda f: f.slot))

    def index(self, fragment: Fragment) -> int:
        """The fragment's place in global order."""
        return self.fragments.index(fragment)

    def previous(self, fragment: Fragment) -> Fragment | None:
        i = self.index(fragment)
        return self.fragments[i - 1] if i > 0 else None

    def next(self, fragment: Fragment) -> Fragment | None:
        i = self.index(fragment)
        return self.fragments[i + 1] if i + 1 < len(self.fragments) else None

    def positions(self, rank: int) -> np.ndarray:
        """int64 ``[T_r]``: the global position of every token of rank ``rank``'s shard."""
        return np.concatenate([np.arange(f.start, f.stop) for f in self.mine(rank)]).astype(np.int64)

    def rank_order(self) -> list[Fragment]:
        """The fragments as the ranks' shards concatenated in rank order hold them."""
        return [f for r in range(self.size) for f in self.mine(r)]

    # --- moving tensors between orders --------------------------------------------------------------
    def to_global(self, xp: TensorOps, x: Tensor, dim: int) -> Tensor:
        """The ranks' shards concatenated in rank order along ``dim`` -> global order (a split
        and a concatenation; the identity for contiguous layouts)."""
        if self.is_contiguous:
            return x
        pieces = dict(
            zip(self.rank_order(), xp.split(x, [f.length for f in self.rank_order()], dim), strict=True)
        )
        return xp.cat([pieces[f] for f in self.fragments], dim)

    def to_rank_order(self, xp: TensorOps, x: Tensor, dim: int) -> Tensor:
        """Inverse of :meth:`to_global`: global order along ``dim`` -> rank after rank."""
        if self.is_contiguous:
            return x
        pieces = dict(zip(self.fragments, xp.split(x, [f.length for f in self.fragments], dim), strict=True))
        return xp.cat([pieces[f] for f in self.rank_order()], dim)

    def local(self, xp: TensorOps, x: Tensor, rank: int, dim: int) -> Tensor:
        """Rank ``rank``'s shard of ``x``, a whole-sequence tensor in global order along ``dim``."""
        index = [slice(None)] * len(x.shape)
        parts = []
        for f in self.mine(rank):
            index[dim] = slice(f.start, f.stop)
            parts.append(x[tuple(index)])
        return parts[0] if len(parts) == 1 else xp.cat(parts, dim)


def layout_mismatch(given: Any, layout: str) -> str | None:
    """Why a batch that says it was cut in layout ``given`` cannot feed a model in ``layout``."""
    if given is None or given == layout:
        return None
    return (
        f"the batch was cut for cp_layout={given!r} but the model was parallelized with layout={layout!r}: "
        f"cut it with shard_for_context_parallel(..., layout={layout!r}) or apply context parallelism "
        f"with layout={given!r}"
    )
