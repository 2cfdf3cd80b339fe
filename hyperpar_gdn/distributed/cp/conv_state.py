"""The conv state of a whole sequence split over the CP ranks (an inference prefill).

A GDN layer's decoding conv state is the last W pre-conv inputs of the whole prompt ``[B, C, W]``
(:mod:`hyperpar_gdn.inference.states`). With contiguous shards they sit at the end of the last
rank's shard, or, when that shard holds fewer than W tokens, at the ends of the last few shards.
Every rank contributes the last ``min(W, T_r)`` inputs of its shard (one all-gather of
``[B, W, C]``), and every rank assembles the same state from them.

Legend: B batch, T_r rank r's tokens, C conv channels, W conv width.
"""

from __future__ import annotations

from collections.abc import Sequence

from hyperpar_gdn.distributed.cp.common import CPGroup
from hyperpar_gdn.inference.states import conv_state_of
from hyperpar_gdn.ops.gdn.layer import LayerWeights, mask_padding
from hyperpar_gdn.platform import Tensor


def shard_conv_tail(cp: CPGroup, w: LayerWeights, x: Tensor, attention_mask: Tensor | None) -> Tensor:
    """The pre-conv inputs (projection of the padding-masked x) of this shard's last
    ``min(W, T_r)`` tokens, zero-padded in front to ``[B, W, C]``."""
    xp, width = cp.xp, w.conv.shape[-1]
    t = x.shape[1]
    keep = min(width, t)
    x_tail = x[:, t - keep :]
    mask_tail = None if attention_mask is None else attention_mask[:, t - keep :]
    mixed = xp.linear(mask_padding(xp, x_tail, mask_tail), w.qkv)
    return xp.pad_dim(mixed, 1, width - keep, 0)


def whole_conv_state(cp: CPGroup, tail_BWC: Tensor, lengths: Sequence[int]) -> Tensor:
    """Every rank's :func:`shard_conv_tail` (shards in sequence order, ``lengths`` tokens each) ->
    the conv state of the whole sequence ``[B, C, W]``, the same on every rank."""
    xp, width = cp.xp, tail_BWC.shape[1]
    gathered = (
        cp.comm.all_gather(tail_BWC, cp.group)
        if cp.size > 1
        else tail_BWC.reshape((1,) + tuple(tail_BWC.shape))
    )  # [cp, B, W, C]
    pieces = [gathered[j][:, width - min(width, t) :] for j, t in enumerate(lengths) if t > 0]
    return conv_state_of(xp, xp.cat(pieces, 1), width)
