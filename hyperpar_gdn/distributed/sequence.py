"""The whole sequence as the softmax-attention layers under context parallelism see it.

Rank r holds the r-th contiguous piece of every row (``lengths[r]`` tokens; pieces may differ),
or, in the head_tail layout, pieces r and 2cp-1-r of 2*cp (:mod:`.layout`).
An attention layer needs, besides its own queries, the keys of every earlier piece, where the
padding is and, for packed documents, which document each key belongs to. A model computes this
:class:`GlobalSequence` once per forward (one exchange of lengths, one small all-gather) and
hands it to every attention layer.

Legend: B batch, T whole sequence, T_r rank r's piece.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hyperpar_gdn.distributed.cp.common import CPGroup, shard_lengths
from hyperpar_gdn.distributed.layout import TokenLayout
from hyperpar_gdn.distributed.mesh import DeviceMesh
from hyperpar_gdn.platform import Tensor


@dataclass(frozen=True)
class GlobalSequence:
    """Attributes:
    lengths: every rank's piece length T_r, in rank order.
    key_mask: ``[B, T]`` padding mask of the whole sequence (1 = token, 0 = padding), or None.
    doc_ids: ``[1, T]`` int, the document of every token (packed documents, B = 1), or None.
    layout: the token layout (``"contiguous"`` or ``"head_tail"``); key_mask and doc_ids are in
        global order whatever it is.
    """

    lengths: tuple[int, ...]
    key_mask: Tensor | None = None
    doc_ids: Tensor | None = None
    layout: str = "contiguous"

    def offset(self, rank: int) -> int:
        """Global position of rank ``rank``'s first token (contiguous layout)."""
        return sum(self.lengths[:rank])

    def token_layout(self) -> TokenLayout:
        return TokenLayout.of(self.layout, self.lengths)


def gather_pieces(
    mesh: DeviceMesh, x: Tensor, lengths: Sequence[int], dim: int, *, upto: int | None = None
) -> Tensor:
    """Concatenate every rank's piece ``x`` along ``dim`` (rank order) -> the whole sequence there.

    Pieces of different lengths are zero-padded to the longest for the all-gather and cut back
    after it. Differentiable: the gradient of each piece returns to its rank. ``upto``: keep only
    the pieces of ranks ``< upto`` (an attention layer needs no later keys)."""
    xp = mesh.platform.ops
    longest = max(lengths)
    padded = xp.pad_dim(x, dim, 0, longest - x.shape[dim])
    gathered = mesh.platform.collectives.all_gather(padded, mesh.get_group())  # [cp, ...]
    index = [slice(None)] * len(x.shape)
    pieces = []
    for rank, length in enumerate(lengths[:upto]):
        index[dim] = slice(0, length)
        pieces.append(gathered[rank][tuple(index)])
    return xp.cat(pieces, dim) if len(pieces) > 1 else pieces[0]


def exchange_lengths(mesh: DeviceMesh, t_local: int | None, error: str | None) -> tuple[int, ...]:
    """Every rank's piece length (one int per rank). ``error``: what is wrong with this rank's
    input, which then stops every rank before any other communication (see ``shard_lengths``)."""
    if mesh.size() == 1:
        if error is not None:
            raise ValueError(error)
        return (int(t_local),)
    return tuple(shard_lengths(CPGroup.of(mesh), 0 if error else int(t_local), error))
