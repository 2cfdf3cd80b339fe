"""The ulysses mode (head parallel): trade the sequence split for a head split and back.

After the local projections, one packed all-to-all turns "all heads, local tokens" into "1/cp of
the heads, all tokens": rank j receives, from every rank, the q, k, v conv channels and the beta
and decay logits of head group j. The conv (with the matching channel slice of its weight) and
the gated delta rule then run on the whole sequence for those heads; a second all-to-all returns
the outputs to "all heads, local tokens". Needs num_k_heads and num_v_heads divisible by cp.
"""

from __future__ import annotations

from hyperpar_gdn.ops import chunk_gated_delta_rule
from hyperpar_gdn.ops.layer import LayerDims, conv_silu, finish, gates, mask_padding, project, split_heads
from hyperpar_gdn.platform import Tensor, TensorOps

from .common import CPGroup, LayerCall


def _head_group_channels(xp: TensorOps, x: Tensor, dims: LayerDims, j: int, cp: int, dim: int) -> Tensor:
    """The q, k and v channels of head group j (of cp) along ``dim`` of x (C channels there)."""
    kd, hk, hv = dims.key_dim, dims.num_k_heads // cp, dims.num_v_heads // cp
    qk_width, v_width = hk * dims.head_k_dim, hv * dims.head_v_dim
    starts_widths = (
        (j * qk_width, qk_width),
        (kd + j * qk_width, qk_width),
        (2 * kd + j * v_width, v_width),
    )
    index = [slice(None)] * len(x.shape)
    parts = []
    for start, width in starts_widths:
        index[dim] = slice(start, start + width)
        parts.append(x[tuple(index)])
    return xp.cat(parts, dim)


def ulysses_forward(cp: CPGroup, call: LayerCall, x: Tensor, attention_mask: Tensor | None) -> Tensor:
    """x ``[B, T/cp, hidden]`` (this rank's shard) -> ``[B, T/cp, hidden]``."""
    xp, w, dims, n = cp.xp, call.weights, call.dims, cp.size
    hv = dims.num_v_heads // n
    x = mask_padding(xp, x, attention_mask)
    mixed, z, b, a = project(xp, w, x)
    bsz, t_local, _ = mixed.shape

    # [cp, B, T/cp, C/cp + 2 H/cp]: row j goes to rank j
    send = xp.stack(
        [
            xp.cat(
                [
                    _head_group_channels(xp, mixed, dims, j, n, 2),
                    b[..., j * hv : (j + 1) * hv],
                    a[..., j * hv : (j + 1) * hv],
                ],
                2,
            )
            for j in range(n)
        ],
        0,
    )
    received = cp.comm.all_to_all(send, [1] * n, [1] * n, cp.group)  # row i: tokens of rank i
    width = received.shape[-1]
    full = xp.permute(received, (1, 0, 2, 3)).reshape(bsz, n * t_local, width)  # [B, T, C/cp + 2 H/cp]
    conv_local = width - 2 * hv
    r = cp.rank
    conv_weight = _head_group_channels(xp, w.conv, dims, r, n, 0)
    mixed_local = conv_silu(xp, full[..., :conv_local], conv_weight)
    q, k, v = split_heads(
        mixed_local,
        num_k_heads=dims.num_k_heads // n,
        num_v_heads=hv,
        head_k_dim=dims.head_k_dim,
        head_v_dim=dims.head_v_dim,
    )
    g, beta = gates(
        xp,
        full[..., conv_local : conv_local + hv],
        full[..., conv_local + hv :],
        w.a_log[r * hv : (r + 1) * hv],
        w.dt_bias[r * hv : (r + 1) * hv],
    )
    o, _ = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=call.chunk_size, use_qk_l2norm_in_kernel=True)

    # [B, T, H/cp, Dv] -> [cp, B, T/cp, H/cp * Dv]: row i goes back to rank i
    o = xp.permute(o.reshape(bsz, n, t_local, hv * dims.head_v_dim), (1, 0, 2, 3))
    back = cp.comm.all_to_all(o, [1] * n, [1] * n, cp.group)  # row j: head group j
    o = xp.permute(back, (1, 2, 0, 3)).reshape(bsz, t_local, dims.num_v_heads, dims.head_v_dim)
    return finish(xp, w, dims, o, z)
