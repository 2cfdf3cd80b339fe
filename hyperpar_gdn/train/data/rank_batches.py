"""A global batch cut into this rank's part: its DP replica's rows, then its CP shard of them.

    shard = cut_batch(batch, mesh["cp"], dp_rank=1, dp_size=2, doc_boundaries=True, layout="head_tail")
    shard.input_ids, shard.labels  # [rows, T_local]; shard.cu_seqlens: int [N+1] or None

The CP cut is the library's own :func:`~hyperpar_gdn.distributed.batch.shard_for_context_parallel`;
this module only prepares what it takes. A :class:`~hyperpar_gdn.train.data.global_batches.Batch` holds windows
of ``T + 1`` tokens, so the label of every input, the last one included, is known: the labels go in
already shifted (``shift_labels``) and no token is lost to the shift.

With ``doc_boundaries`` and a document starting inside a row, the replica's rows are packed into
one row of ``rows * T`` tokens whose documents (row starts included) are its ``cu_seqlens``: the
GDN state, the conv and attention restart at each, and the last token of a document learns no label
(its next token opens another document). Otherwise the rows stay plain windows of the stream.

Legend: B rows of the global batch, T tokens per row (inputs), rows = B / dp.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hyperpar_gdn.distributed.batch import ContextParallelBatch, shard_for_context_parallel
from hyperpar_gdn.platform.base import IGNORE_INDEX
from hyperpar_gdn.train.data.global_batches import Batch

__all__ = ["ReplicaRows", "cut_batch", "replica_rows"]


@dataclass(frozen=True)
class ReplicaRows:
    """One DP replica's rows before the CP cut.

    Attributes:
        input_ids: int64 ``[rows, T]``, or ``[1, rows * T]`` when packed.
        shift_labels: int64, ``input_ids``' shape: the next token of each input, ``IGNORE_INDEX``
            where none is learnt.
        cu_seqlens: int64 ``[N+1]`` over the packed row, or None.
    """

    input_ids: torch.Tensor
    shift_labels: torch.Tensor
    cu_seqlens: torch.Tensor | None

    @property
    def labelled_tokens(self) -> int:
        """How many tokens have a label (the divisor of the replica's mean loss)."""
        return int((self.shift_labels != IGNORE_INDEX).sum())


def replica_rows(batch: Batch, *, dp_rank: int, dp_size: int, doc_boundaries: bool) -> ReplicaRows:
    """The rows of DP replica ``dp_rank`` of ``dp_size`` from a global batch ``[B, T+1]``, their
    labels shifted (and packed into one row, see the module docstring)."""
    rows, width = batch.tokens.shape
    if rows % dp_size:
        raise ValueError(f"a batch of {rows} sequences does not split over dp={dp_size}")
    b = rows // dp_size
    part = slice(dp_rank * b, (dp_rank + 1) * b)
    tokens, starts = batch.tokens[part], batch.doc_starts[part]
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    if not (doc_boundaries and batch.has_documents):
        return ReplicaRows(inputs, labels, None)
    labels = labels.masked_fill(starts[:, 1:], IGNORE_INDEX)
    row_starts = starts[:, :-1].clone()
    row_starts[:, 0] = True
    cu = torch.cat([row_starts.reshape(-1).nonzero()[:, 0], torch.tensor([row_starts.numel()])])
    return ReplicaRows(inputs.reshape(1, -1), labels.reshape(1, -1), cu)


def cut_batch(
    batch: Batch,
    cp_mesh: Any,
    *,
    dp_rank: int,
    dp_size: int,
    doc_boundaries: bool = True,
    layout: str = "contiguous",
) -> ContextParallelBatch:
    """This rank's part of a global batch ``[B, T+1]``: the rows of DP replica ``dp_rank``, the
    tokens of this rank of ``cp_mesh`` (1-D) in the token ``layout`` (no communication).

    Returns the :class:`~hyperpar_gdn.distributed.batch.ContextParallelBatch` of
    ``shard_for_context_parallel``: ``input_ids`` and ``labels`` ``[rows, T/cp]`` (``[1, rows*T/cp]``
    packed), ``cu_seqlens`` over the replica's whole packed row (the same on its CP ranks) or None.
    """
    rows, width = batch.tokens.shape
    cp = cp_mesh.size()
    if rows % dp_size or (width - 1) % cp:
        raise ValueError(
            f"a batch of {rows} sequences of {width - 1} tokens does not split over dp={dp_size}, cp={cp}"
        )
    mine = replica_rows(batch, dp_rank=dp_rank, dp_size=dp_size, doc_boundaries=doc_boundaries)
    return shard_for_context_parallel(
        cp_mesh, mine.input_ids, shift_labels=mine.shift_labels, cu_seqlens=mine.cu_seqlens, layout=layout
    )
