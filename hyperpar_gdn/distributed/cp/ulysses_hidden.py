"""The ulysses_hidden mode: ulysses' head split, exchanging the layer's hidden states instead of
its projected heads.

Rank j owns the heads that ulysses gives it (:class:`~.ulysses.HeadShare`). Every rank gathers
the group's layer input ``[B, T, hidden]``, projects its own heads' channels over all T tokens
(conv channels, beta and decay logits, output gate: the rows of the projection weights that ulysses
would have sent it), runs the conv and the rule on them as ulysses does, then the gated norm and
the output projection's columns of its heads: a partial sum ``[B, T, hidden]`` of the layer's
output. A second exchange sends every rank the partial sums of its own tokens, which it adds in
rank order. The backward of the gather is a reduce-scatter of the input's gradient, that of the
reduce-scatter an all-gather of the output's gradient (both as all-to-alls, so shards may differ
in length).

Elements each rank sends per direction, forward (the backward the same), T_r its tokens:

- ulysses: (cp-1)/cp T_r (C + 2H) in, (cp-1)/cp T_r H Dv out;
- ulysses_hidden: (cp-1) T_r hidden in and out.

So it sends less when 2 cp hidden < C + 2H + H Dv: models whose heads are wide beside their hidden
size, at small cp (the benchmark model of docs/modes.md at cp=2: a quarter of the bytes). The
FLOPs are ulysses' (each rank projects T tokens for 1/cp of the heads instead of T/cp tokens for
all); the output projection's sum over heads is split over the ranks, so in bf16 it rounds once
per rank, as a row-parallel linear layer does.

Legend: B batch, T tokens (all ranks), T_r rank r's tokens, H value heads, Dv value head dim, C
conv channels, hv = H/cp value heads per rank.
"""

from __future__ import annotations

from collections.abc import Sequence

from hyperpar_gdn.distributed.cp.common import CPGroup, LayerCall
from hyperpar_gdn.distributed.cp.ulysses import (
    HeadShare,
    from_token_blocks,
    gather_head_states,
    heads_whole_sequence,
    to_token_blocks,
)
from hyperpar_gdn.distributed.layout import TokenLayout
from hyperpar_gdn.ops.gdn.layer import PROJECTIONS, LayerDims, LayerWeights, gated_rms_norm, mask_padding
from hyperpar_gdn.ops.gdn.varlen import Documents
from hyperpar_gdn.ops.projections import Projection, linear_weight, wrapper_of
from hyperpar_gdn.platform import Tensor, TensorOps


def _own_weights(xp: TensorOps, w: LayerWeights, mine: HeadShare, dims: LayerDims) -> tuple[Tensor, Tensor]:
    """(input rows ``[width + hv*Dv, hidden]``: this rank's conv channels, beta and decay logits
    (what ulysses sends it, in that order), then its output gate; output columns ``[hidden,
    hv*Dv]``) of the layer's weights. The projections must be plain linear layers
    (:func:`ulysses_hidden_error` refuses the others before any change)."""
    qkv, z, b, a, out = (_weight(p) for p in (w.qkv, w.z, w.b, w.a, w.out))
    heads = slice(mine.v_start, mine.v_start + mine.v_count)
    gate = slice(mine.v_start * dims.head_v_dim, (mine.v_start + mine.v_count) * dims.head_v_dim)
    w_in = xp.cat([xp.take(qkv, mine.conv_channels(dims), 0), b[heads], a[heads], z[gate]], 0)
    return w_in, out[:, gate]


def _weight(p: Projection) -> Tensor:
    weight = linear_weight(p)
    if weight is None:
        raise NotImplementedError(f"mode 'ulysses_hidden': {_refusal('a projection', p)}")
    return weight


def _refusal(name: str, module: object) -> str:
    wrapper = wrapper_of(module) or type(module).__qualname__
    return (
        f"{name} is {wrapper}, not a plain linear layer: ulysses_hidden projects this rank's heads with "
        "rows of the projection weights, which would bypass it; use mode='ulysses' (the same head split, "
        "calling the module)"
    )


def ulysses_hidden_error(module: object, where: str) -> str | None:
    """Why ulysses_hidden cannot serve the GDN layer ``module`` (``where``: how the error names
    it), or None: every projection must be a plain linear layer."""
    for name in PROJECTIONS:
        if linear_weight(getattr(module, name)) is None:
            return f"mode 'ulysses_hidden': {_refusal(f'{where}.{name}', getattr(module, name))}"
    return None


def ulysses_hidden_forward(
    cp: CPGroup,
    call: LayerCall,
    x: Tensor,
    attention_mask: Tensor | None,
    lengths: Sequence[int],
    docs: Documents | None = None,
    layout: TokenLayout | None = None,
    *,
    final_state: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """x ``[B, T_r, hidden]`` (this rank's shard; ``lengths[j]`` = T_j on every rank) ->
    ``[B, T_r, hidden]``; ``docs``, ``layout`` and ``final_state`` as in
    :func:`~.ulysses.ulysses_forward` (the same results, other exchanges)."""
    xp, dims, n, r = cp.xp, call.dims, cp.size, cp.rank
    mine = HeadShare.of(dims, n, r)
    x = mask_padding(xp, x, attention_mask)
    bsz, t_local, hidden = x.shape
    flat = x.reshape(-1)
    gathered = cp.comm.all_to_all(  # this rank's shard to every rank; the gradient comes back summed
        xp.cat([flat] * n, 0), [bsz * t_local * hidden] * n, [bsz * t * hidden for t in lengths], cp.group
    )
    x_all = from_token_blocks(xp, gathered, bsz, lengths, hidden)  # [B, T, hidden], rank order
    if layout is not None:
        x_all = layout.to_global(xp, x_all, 1)
    w_in, w_out = _own_weights(xp, call.weights, mine, dims)
    hv, dv = mine.v_count, dims.head_v_dim
    full, z = xp.split(xp.linear(x_all, w_in), [mine.width(dims), hv * dv], 2)
    o, s_mine = heads_whole_sequence(xp, call, mine, full, docs, final_state=final_state)
    t = sum(lengths)
    normed = gated_rms_norm(xp, o, z.reshape(bsz, t, hv, dv), call.weights.norm, dims.norm_eps)
    partial = xp.linear(normed.reshape(bsz, t, hv * dv), w_out)  # [B, T, hidden], this rank's heads
    if layout is not None:
        partial = layout.to_rank_order(xp, partial, 1)
    parts = cp.comm.all_to_all(
        to_token_blocks(xp, partial, lengths),
        [bsz * t * hidden for t in lengths],
        [bsz * t_local * hidden] * n,
        cp.group,
    ).reshape(n, bsz, t_local, hidden)
    y = parts[0]
    for j in range(1, n):  # in rank order, the same sum on every rank
        y = y + parts[j]
    if not final_state:
        return y
    return y, gather_head_states(cp, dims, s_mine)
