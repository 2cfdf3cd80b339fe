"""The gated delta rule, written once against the platform's tensor functions.

Layout ``[B, T, H, D]``, state ``[B, H, K, V]``; q is scaled by K^-0.5 inside; q/k heads are
repeated (interleaved) to the value heads when fewer. Packed documents: keyword ``cu_seqlens``
(fla's contract, B = 1; see :mod:`.varlen`).

- :mod:`.naive`: the token-by-token reference (the definition);
- :mod:`.chunk`, :mod:`.recurrence`, :mod:`.recurrence_batched`: the chunked fast path;
- :mod:`.summary`, :mod:`.onepass`: a segment's affine summary, and outputs plus summary in one pass;
- :mod:`.varlen`: packed-document descriptions; :mod:`.layer`: the whole Qwen3.5 GDN layer as
  stages; :mod:`.decode`: its one-token step.
"""

from hyperpar_gdn.ops.gdn.chunk import ChunkPrep, chunk_gated_delta_rule, outputs_from, prepare_chunks
from hyperpar_gdn.ops.gdn.naive import recurrent_gated_delta_rule
from hyperpar_gdn.ops.gdn.summary import (
    Summary,
    apply_summary,
    compose_summaries,
    gdn_state_summary,
    summary_from,
)
from hyperpar_gdn.ops.gdn.varlen import check_cu_seqlens, cu_seqlens_from_position_ids

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
