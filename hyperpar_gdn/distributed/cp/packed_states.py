"""The decoding state of every prompt of a packed row read under context parallelism.

A prefill of N prompts packed in one row (B = 1, the global ``cu_seqlens`` ``[N+1]``, contiguous
shards) needs, per GDN layer and prompt n, the state a decoder of that prompt alone continues
from (:mod:`hyperpar_gdn.ops.prefill_states`): the conv state (the last W pre-conv inputs of the
prompt, zeros before its first token) and the recurrent state after its last token. A prompt ends
on exactly one rank, which computes both; one all-reduce (zeros from the other ranks) gives every
rank all N.

- Recurrent states (:func:`doc_final_states`): the rank runs the gated delta rule once more over
  its shard cut at the document starts (fla's ``cu_seqlens`` form), the first piece entered by
  the state entering the shard (the CP mode's S_in) when its prompt began on an earlier rank, the
  others from zero; a piece whose prompt ends in the shard gives that prompt's state. This costs
  one more pass over the shard's GDN recurrence in a packed prefill (none otherwise).
- Conv states (:func:`doc_conv_states`): the W-1 pre-conv inputs before the shard (one all-gather
  of every rank's last W) and the shard's own give every window of W inputs that ends in it.

Legend: N prompts, P pieces of this shard, T_r this rank's tokens, C conv channels, W conv width,
H value heads, K/V head dims.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hyperpar_gdn.distributed.cp.common import CPGroup
from hyperpar_gdn.ops.gdn.kernels import gdn_rule
from hyperpar_gdn.ops.prefill_states import conv_state_of
from hyperpar_gdn.platform import Tensor

__all__ = ["ShardPieces", "doc_conv_states", "doc_final_states"]


class ShardPieces:
    """This rank's shard cut at the document starts.

    Attributes:
        offset: global position of the shard's first token.
        cu: int ``[P+1]``, the pieces' local bounds (fla's ``cu_seqlens`` for the shard).
        docs: int ``[P]``, the document of each piece.
        ends: bool ``[P]``, whether the piece holds its document's last token.
        continues: whether piece 0's document began on an earlier rank.
    """

    def __init__(self, doc_starts: np.ndarray, lengths: Sequence[int], rank: int) -> None:
        """``doc_starts``: bool ``[T]`` of the whole sequence, True where a document starts."""
        starts = np.flatnonzero(np.asarray(doc_starts))
        cu = np.unique(np.concatenate([[0], starts, [len(doc_starts)]])).astype(np.int64)
        self.offset = int(sum(lengths[:rank]))
        t = int(lengths[rank])
        inner = [int(c) - self.offset for c in cu if 0 < c - self.offset < t]
        self.cu = np.array([0, *inner, t], dtype=np.int64)
        first = int(np.searchsorted(cu, self.offset, side="right")) - 1
        self.docs = np.arange(first, first + len(self.cu) - 1)
        self.ends = cu[self.docs + 1] == self.cu[1:] + self.offset
        self.continues = bool(cu[first] < self.offset)
        self.num_docs = len(cu) - 1
        self.starts = cu[self.docs] - self.offset  # local position of each piece's document start


def _scatter_rows(cp: CPGroup, pieces: ShardPieces, rows: list[Tensor], like: Tensor) -> Tensor:
    """``[N, ...]``: row n from the rank where prompt n ends (``rows[i]`` for piece i), summed
    over the CP group."""
    xp = cp.xp
    zero = xp.zeros(tuple(like.shape), like=like)
    mine = {int(d): row for d, row, end in zip(pieces.docs, rows, pieces.ends, strict=True) if end}
    out = xp.stack([mine.get(n, zero) for n in range(pieces.num_docs)], 0)
    return cp.comm.all_reduce_sum(out, cp.group) if cp.size > 1 else out


def doc_final_states(
    cp: CPGroup,
    pieces: ShardPieces,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    s_in: Tensor,
    *,
    chunk_size: int,
    kernel: str = "native",
) -> Tensor:
    """The recurrent state after every prompt's last token ``[N, H, K, V]`` (compute dtype), the
    same on every rank.

    Args:
        q, k ``[1, T_r, Hk, K]``, v ``[1, T_r, H, V]``, g and beta ``[1, T_r, H]``: this shard's
            inputs to the rule (after the conv; q and k not yet normalized).
        s_in: ``[1, H, K, V]``, the state entering the shard (the CP mode's).
        kernel: the local kernel, ``"native"`` or ``"fla"`` (:mod:`hyperpar_gdn.ops.gdn.kernels`).
    """
    xp = cp.xp
    initial = [xp.zeros(tuple(s_in.shape[1:]), like=s_in) for _ in pieces.docs]
    if pieces.continues:
        initial[0] = s_in[0]
    _, finals = gdn_rule(
        q,
        k,
        v,
        g,
        beta,
        kernel=kernel,
        chunk_size=chunk_size,
        initial_state=xp.stack(initial, 0),
        output_final_state=True,
        cu_seqlens=pieces.cu,
    )  # [P, H, K, V]
    rows = [finals[i] for i in range(len(pieces.docs))]
    return _scatter_rows(cp, pieces, rows, rows[0])


def doc_conv_states(
    cp: CPGroup, pieces: ShardPieces, mixed_BTC: Tensor, lengths: Sequence[int], width: int
) -> Tensor:
    """The conv state of every prompt ``[N, C, W]`` (its last W pre-conv inputs, zeros before its
    first token), the same on every rank; ``mixed_BTC`` ``[1, T_r, C]`` is this shard's pre-conv
    projection."""
    xp = cp.xp
    t = mixed_BTC.shape[1]
    keep = min(width, t)
    tail = xp.pad_dim(mixed_BTC[:, t - keep :], 1, width - keep, 0)  # [1, W, C]
    gathered = cp.comm.all_gather(tail, cp.group) if cp.size > 1 else tail.reshape((1, *tuple(tail.shape)))
    before = [gathered[j][:, width - min(width, lengths[j]) :] for j in range(cp.rank) if lengths[j] > 0]
    prefix = xp.cat(before, 1) if before else mixed_BTC[:, :0]
    prefix = conv_state_of(xp, prefix, width - 1)  # [1, C, W-1]: the W-1 inputs before the shard
    buffer = xp.cat([xp.swapaxes(prefix, 1, 2), mixed_BTC], 1)  # [1, W-1+T_r, C]
    rows = []
    for start, stop in zip(pieces.starts, pieces.cu[1:], strict=True):
        first = max(int(start), int(stop) - width) + width - 1
        rows.append(conv_state_of(xp, buffer[:, first : int(stop) + width - 1], width)[0])
    return _scatter_rows(cp, pieces, rows, rows[0])
