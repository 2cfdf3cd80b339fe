"""The per-forward context of a model under context parallelism: the whole sequence as its mixers see it.

Rank r holds the r-th contiguous piece of every row (``lengths[r]`` tokens; pieces may differ),
or, in the head_tail layout, pieces r and 2cp-1-r of 2*cp (:mod:`.layout`).
An attention layer needs, besides its own queries, the keys of every earlier piece, where the
padding is and, for packed documents, which document each key belongs to. A model computes this
:class:`GlobalSequence` once per forward (one exchange of lengths, one small all-gather) and
hands it to every mixer explicitly: as the ``cp_context=`` keyword where this library owns the
signatures (HybridLM, its blocks, the styles' forwards), and for transformers models through a
:class:`ContextHolder` that the model's forward pre-hook fills and the mixers read (transformers'
decoder layers pass no extra keyword to their GDN layer). It also carries every host-side description of the sequence (the
piece lengths, the padding mask and the packed documents' boundaries as numpy arrays), so that no
layer copies a device tensor to the host: on a GPU or NPU each such copy is a synchronisation
that stalls the launch queue, and it would be paid once per layer.

Legend: B batch, T whole sequence, T_r rank r's piece.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hyperpar_gdn.distributed.cp.common import CPGroup, shard_lengths
from hyperpar_gdn.distributed.layout import TokenLayout
from hyperpar_gdn.distributed.mesh import DeviceMesh
from hyperpar_gdn.ops.gdn.varlen import check_cu_seqlens
from hyperpar_gdn.platform import Tensor


@dataclass(frozen=True)
class GlobalSequence:
    """Build one with :meth:`build` (it validates the host-side parts).

    Attributes:
        lengths: every rank's piece length T_r, in rank order.
        key_mask: ``[B, T]`` padding mask of the whole sequence on the device (1 = token,
            0 = padding), or None: the GDN layers zero their padded rows with it.
        host_key_mask: the same mask on the host, bool ``[B, T]``, or None: what the attention
            plans read.
        cu_seqlens: packed documents (B = 1), host int64 ``[N+1]`` over the whole sequence
            (validated against ``sum(lengths)``), or None.
        layout: the token layout (``"contiguous"`` or ``"head_tail"``); masks and documents are in
            global order whatever it is.
    """

    lengths: tuple[int, ...]
    key_mask: Tensor | None = None
    host_key_mask: np.ndarray | None = None
    cu_seqlens: np.ndarray | None = None
    layout: str = "contiguous"

    @classmethod
    def build(
        cls,
        lengths: Sequence[int],
        *,
        layout: str = "contiguous",
        key_mask: Tensor | None = None,
        host_key_mask: Any = None,
        cu_seqlens: Any = None,
    ) -> GlobalSequence:
        """Validate and gather the per-forward description. ``cu_seqlens``: a host array or
        sequence of ints (a device tensor is copied once, here). ``host_key_mask`` must be given
        with ``key_mask`` (the caller has both: it built the device mask from host values)."""
        lengths = tuple(int(t) for t in lengths)
        if (key_mask is None) != (host_key_mask is None):
            raise ValueError("GlobalSequence.build: give key_mask and host_key_mask together, or neither")
        cu = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, seq_len=sum(lengths))
        host = None if host_key_mask is None else np.asarray(host_key_mask) != 0
        seq = cls(lengths, key_mask=key_mask, host_key_mask=host, cu_seqlens=cu, layout=layout)
        seq.token_layout()  # head_tail: every rank holds two equal pieces (the same error on every rank)
        return seq

    def offset(self, rank: int) -> int:
        """Global position of rank ``rank``'s first token (contiguous layout)."""
        return sum(self.lengths[:rank])

    def token_layout(self) -> TokenLayout:
        return TokenLayout.of(self.layout, self.lengths)

    def doc_ids(self) -> np.ndarray | None:
        """int64 ``[T]``: the document of every token (packed documents), or None."""
        if self.cu_seqlens is None:
            return None
        return np.repeat(np.arange(len(self.cu_seqlens) - 1), np.diff(self.cu_seqlens))


class ContextHolder:
    """Where a transformers model's forward pre-hook leaves the :class:`GlobalSequence` of the
    current forward for its mixers (one holder per model, made by
    :func:`~hyperpar_gdn.apply_context_parallel`).

    The context stays until the next forward replaces it, so a layer recomputed under activation
    checkpointing in the backward reads its own forward's context, provided each backward runs
    before the next forward (as every training loop does); a recomputation after another forward
    of other lengths stops with the lengths' error (:func:`~.gdn_call.check_known`)."""

    def __init__(self) -> None:
        self.current: GlobalSequence | None = None

    def get(self, owner: str) -> GlobalSequence:
        """The current forward's context; an error naming ``owner`` when no model forward set one."""
        if self.current is None:
            raise NotImplementedError(
                f"{owner} under context parallelism reads the whole sequence's description from its "
                "model's forward (apply_context_parallel(model, ...)): call the whole model, not the layer alone"
            )
        return self.current


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
