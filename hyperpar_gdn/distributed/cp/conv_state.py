"""The conv state of a whole sequence split over the CP ranks (an inference prefill).

A GDN layer's decoding conv state is the last W pre-conv inputs of the whole prompt ``[B, C, W]``
(:mod:`hyperpar_gdn.ops.prefill_states`). They sit at the end of the sequence's last fragment in
global order (contiguous shards: the last rank's; head_tail: rank 0's tail piece) or, when that
fragment holds fewer than W tokens, at the ends of the last few fragments. Every rank contributes
the last ``min(W, P)`` inputs of each of its fragments (one all-gather of ``[B, n*W, C]``, n
fragments per rank), and every rank assembles the same state from them in global order.

Legend: B batch, P a fragment's tokens, C conv channels, W conv width, n fragments per rank.
"""

from __future__ import annotations

from collections.abc import Sequence

from hyperpar_gdn.distributed.cp.common import CPGroup
from hyperpar_gdn.distributed.layout import Fragment, TokenLayout
from hyperpar_gdn.ops.gdn.layer import LayerWeights, mask_padding
from hyperpar_gdn.ops.prefill_states import conv_state_of
from hyperpar_gdn.platform import Tensor


def shard_conv_tail(
    cp: CPGroup,
    w: LayerWeights,
    x: Tensor,
    attention_mask: Tensor | None,
    fragments: Sequence[Fragment],
) -> Tensor:
    """The pre-conv inputs (projection of the padding-masked x ``[B, T_r, hidden]``) of the last
    ``min(W, P)`` tokens of each of this rank's ``fragments`` (in slot order), each zero-padded in
    front to W: ``[B, n*W, C]``."""
    xp, width = cp.xp, w.conv.shape[-1]
    tails = []
    for f in fragments:
        keep = min(width, f.length)
        stop = f.local_start + f.length
        x_tail = x[:, stop - keep : stop]
        mask_tail = None if attention_mask is None else attention_mask[:, stop - keep : stop]
        mixed = w.qkv(mask_padding(xp, x_tail, mask_tail))
        tails.append(xp.pad_dim(mixed, 1, width - keep, 0))
    return tails[0] if len(tails) == 1 else xp.cat(tails, 1)


def whole_conv_state(cp: CPGroup, tail_BNC: Tensor, tokens: TokenLayout) -> Tensor:
    """Every rank's :func:`shard_conv_tail` -> the conv state of the whole sequence
    ``[B, C, W]``, the same on every rank (``tokens``: the layout and every rank's length)."""
    xp = cp.xp
    n = len(tokens.mine(cp.rank))
    width = tail_BNC.shape[1] // n
    gathered = (
        cp.comm.all_gather(tail_BNC, cp.group)
        if cp.size > 1
        else tail_BNC.reshape((1,) + tuple(tail_BNC.shape))
    )  # [cp, B, n*W, C]
    pieces = [
        gathered[f.rank][:, (f.slot + 1) * width - min(width, f.length) : (f.slot + 1) * width]
        for f in tokens.fragments
        if f.length > 0
    ]
    return conv_state_of(xp, xp.cat(pieces, 1), width)
