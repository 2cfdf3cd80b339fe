"""The per-forward context of a model under context parallelism: the whole sequence as its mixers see it.

Rank r holds the r-th contiguous piece of every row (``lengths[r]`` tokens; pieces may differ),
or, in the head_tail layout, pieces r and 2cp-1-r of 2*cp (:mod:`.layout`).
An attention layer needs, besides its own queries, the keys of every earlier piece, where the
padding is and, for packed documents, which document each key belongs to. A model computes this
:class:`GlobalSequence` once per forward (one exchange of lengths, one small all-gather) and
hands it to every mixer explicitly, as the ``cp_context=`` keyword: HybridLM passes it to its
blocks, and a transformers model's forward pre-hook adds it to the text model's keywords, which
its decoder layers pass on to both mixers. A mixer called without it (a layer on its own)
describes its own call's sequence; nothing of an earlier forward is kept anywhere.

It carries every host-side description of the sequence (the piece lengths, the padding mask, the
packed documents' boundaries and starts as numpy arrays), checked once when it is built, so that
no layer copies a device tensor to the host or checks the documents again: on a GPU or NPU each
host copy is a synchronisation that stalls the launch queue, and it would be paid once per layer.
It is one rank's view: its piece of the padding mask is cut once, when it is built, and the
documents of the spans its GDN layers run on once, by the first layer that asks, with the masks
the layers build from them (:class:`~hyperpar_gdn.ops.gdn.varlen.Documents`): the later GDN
layers of the forward check nothing, build nothing on the host and copy nothing to the device.

Legend: B batch, T whole sequence, T_r rank r's piece.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hyperpar_gdn.distributed.cp.common import CPGroup, shard_lengths
from hyperpar_gdn.distributed.cp.packed_states import ShardPieces
from hyperpar_gdn.distributed.layout import TokenLayout
from hyperpar_gdn.distributed.mesh import DeviceMesh
from hyperpar_gdn.ops.gdn.varlen import Documents, check_cu_seqlens
from hyperpar_gdn.platform import Tensor, ops_for


class ForwardMemo:
    """What the layers of one forward compute once and share: ``documents``, the packed documents
        of the token spans the GDN layers run on (:class:`~hyperpar_gdn.ops.gdn.varlen.Documents`,
        which keep the masks built from them, on the device too) and, in a prefill of packed prompts,
    ``shard_pieces``. A plain object, neither a dataclass
        nor a container: a wrapper that rebuilds the context per module to cast its tensors (FSDP2's
        mixed precision does, with ``dataclasses.replace``) copies the reference, so the layers still
        share one memo."""

    def __init__(self) -> None:
        self.documents: dict[tuple[tuple[tuple[int, int], ...], int], Documents] = {}
        self.shard_pieces: ShardPieces | None = None


@dataclass(frozen=True)
class GlobalSequence:
    """The whole sequence as rank ``rank`` of the CP group sees it in one forward. Build one with
    :meth:`build` (it checks the host-side parts once).

    Attributes:
        lengths: every rank's piece length T_r, in rank order.
        rank: the CP rank whose context this is.
        key_mask: ``[B, T]`` padding mask of the whole sequence on the device (1 = token,
            0 = padding), or None.
        local_key_mask: this rank's piece of it, ``[B, T_r]`` (rank order of the layout), or None:
            the GDN layers zero their padded rows with it.
        host_key_mask: the whole mask on the host, bool ``[B, T]``, or None: what the attention
            plans read.
        cu_seqlens: packed documents (B = 1), host int64 ``[N+1]`` over the whole sequence
            (checked against ``sum(lengths)``), or None.
        doc_starts: the same documents as host bool ``[T]``, True where one starts, or None.
        layout: the token layout (``"contiguous"`` or ``"head_tail"``); masks and documents are in
            global order whatever it is.
    """

    lengths: tuple[int, ...]
    rank: int = 0
    key_mask: Tensor | None = None
    local_key_mask: Tensor | None = None
    host_key_mask: np.ndarray | None = None
    cu_seqlens: np.ndarray | None = None
    doc_starts: np.ndarray | None = None
    layout: str = "contiguous"
    # What the first layer that needs it computes for the others: see ForwardMemo.
    memo: ForwardMemo = field(default_factory=ForwardMemo, repr=False, compare=False)

    @classmethod
    def build(
        cls,
        lengths: Sequence[int],
        *,
        rank: int,
        layout: str = "contiguous",
        key_mask: Tensor | None = None,
        host_key_mask: Any = None,
        cu_seqlens: Any = None,
    ) -> GlobalSequence:
        """Check and gather the per-forward description of ``rank``'s view. ``cu_seqlens``: a host
        array or sequence of ints (a device tensor is copied once, here). ``host_key_mask`` must
        be given with ``key_mask`` (the caller has both: it built the device mask from host
        values)."""
        lengths = tuple(int(t) for t in lengths)
        if (key_mask is None) != (host_key_mask is None):
            raise ValueError("GlobalSequence.build: give key_mask and host_key_mask together, or neither")
        if not 0 <= rank < len(lengths):
            raise ValueError(f"GlobalSequence.build: rank={rank} is not one of the {len(lengths)} CP ranks")
        tokens = TokenLayout.of(layout, lengths)  # head_tail: two equal pieces (the same error on every rank)
        cu = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, seq_len=sum(lengths))
        starts = None
        if cu is not None:
            starts = np.zeros(sum(lengths), dtype=bool)
            starts[cu[:-1]] = True
        local = None if key_mask is None else tokens.local(ops_for(key_mask), key_mask, rank, 1)
        return cls(
            lengths,
            rank=rank,
            key_mask=key_mask,
            local_key_mask=local,
            host_key_mask=None if host_key_mask is None else np.asarray(host_key_mask) != 0,
            cu_seqlens=cu,
            doc_starts=starts,
            layout=layout,
        )

    def offset(self, rank: int) -> int:
        """Global position of rank ``rank``'s first token (contiguous layout)."""
        return sum(self.lengths[:rank])

    def token_layout(self) -> TokenLayout:
        return TokenLayout.of(self.layout, self.lengths)

    def doc_ids(self) -> np.ndarray | None:
        """int64 ``[T]``: the document of every token (packed documents), or None."""
        return None if self.doc_starts is None else np.cumsum(self.doc_starts) - 1

    def documents(self, spans: Sequence[tuple[int, int]], width: int) -> Documents | None:
        """The packed documents of the token spans ``(start, length)`` (global order, all of one
        length; one row each), each with the ``width - 1`` tokens before it as its conv halo, or
        None without packed documents. Made once per forward, by the first GDN layer that asks,
        and kept here with the masks the layers build from them."""
        if self.doc_starts is None:
            return None
        key = (tuple((int(a), int(t)) for a, t in spans), width)
        if key not in self.memo.documents:
            before = np.concatenate([np.zeros(width - 1, dtype=bool), self.doc_starts])
            starts = np.stack([self.doc_starts[a : a + t] for a, t in key[0]])
            halo = np.stack([before[a : a + width - 1] for a, _ in key[0]])
            self.memo.documents[key] = Documents(starts, halo)
        return self.memo.documents[key]

    def shard_docs(self, width: int, *, by_fragment: bool) -> Documents | None:
        """The packed documents of this rank's shard as a conv of ``width`` taps sees them: one
        row per fragment of the shard (``by_fragment``), or one for the contiguous piece
        ``[offset(rank), offset(rank) + T_r)``; None without packed documents."""
        r = self.rank
        if by_fragment:
            return self.documents([(f.start, f.length) for f in self.token_layout().mine(r)], width)
        return self.documents([(self.offset(r), self.lengths[r])], width)

    def shard_pieces(self) -> ShardPieces | None:
        """This rank's shard (contiguous layout) cut at the packed documents' starts, or None: what a
        prefill of packed prompts reads a state per prompt from. Made once per forward."""
        if self.doc_starts is None:
            return None
        if self.memo.shard_pieces is None:
            self.memo.shard_pieces = ShardPieces(self.doc_starts, self.lengths, self.rank)
        return self.memo.shard_pieces

    def whole_docs(self) -> Documents | None:
        """The packed documents of the whole sequence (one row, no halo), or None."""
        return self.documents([(0, sum(self.lengths))], 1)


def check_context(
    seq: Any,
    owner: str,
    *,
    layout: str,
    rank: int,
    tokens: int,
    given: Sequence[str] = (),
    error: str | None = None,
) -> GlobalSequence:
    """``seq``, the context a model's forward passed as ``cp_context=``, if it fits the call of a
    layer (``owner``, for the messages) parallelized in ``layout`` on CP rank ``rank`` whose shard
    holds ``tokens`` tokens; ``given``: the names of the call's own padding or document keywords,
    which the context replaces (refused); ``error``: what the layer found wrong with its own
    input. The model checked its inputs on every rank before it exchanged the lengths, so a
    ValueError here is the same on every rank unless the model itself is wrong."""
    if not isinstance(seq, GlobalSequence):
        raise TypeError(
            f"cp_context must be a GlobalSequence (built by the model's forward); got {type(seq).__name__}"
        )
    if seq.layout != layout:
        error = f"the model's forward passed a sequence in layout={seq.layout!r} to {owner} parallelized with layout={layout!r}"
    elif seq.rank != rank:
        error = f"the model's forward passed CP rank {seq.rank}'s context to {owner} on CP rank {rank}"
    elif given:
        error = (
            f"the model's forward describes the whole sequence (its padding and documents) once, in cp_context; "
            f"{owner} got {', '.join(sorted(given))} as well"
        )
    elif error is None and tokens != seq.lengths[rank]:
        error = f"the hidden states hold {tokens} tokens but the model's forward exchanged T_r={seq.lengths[rank]} for CP rank {rank}"
    if error is not None:
        raise ValueError(error)
    return seq


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
