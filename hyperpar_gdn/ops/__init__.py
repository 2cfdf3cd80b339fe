"""Gated delta rule functions, written once against the platform's tensor functions.

Layout ``[B, T, H, D]``, state ``[B, H, K, V]``; q is scaled by K^-0.5 inside; q/k heads are
repeated (interleaved) to the value heads when fewer. Packed documents: keyword ``cu_seqlens``
(fla's contract, B = 1; see :mod:`hyperpar_gdn.ops.varlen`).
"""

from .chunk import ChunkPrep, chunk_gated_delta_rule, outputs_from, prepare_chunks
from .naive import recurrent_gated_delta_rule
from .summary import Summary, apply_summary, compose_summaries, gdn_state_summary, summary_from
from .varlen import check_cu_seqlens, cu_seqlens_from_position_ids

__all__ = [
    "ChunkPrep",
    "Summary",
    "apply_summary",
    "check_cu_seqlens",
    "chunk_gated_delta_rule",
    "compose_summaries",
    "cu_seqlens_from_position_ids",
    "gdn_state_summary",
    "outputs_from",
    "prepare_chunks",
    "recurrent_gated_delta_rule",
    "summary_from",
]
