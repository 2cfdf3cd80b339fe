"""One decoding step of a GDN layer from its decoding state, on any framework.

The state after a prompt (:mod:`hyperpar_gdn.ops.prefill_states`) is the conv state, the last W
pre-conv inputs ``[B, C, W]``, and the recurrent state S ``[B, H, K, V]``. A new token x
``[B, 1, hidden]``:

1. mixed = in_proj_qkv(x); the conv window is the state's last W-1 inputs and mixed, the new conv
   state; conv output = SiLU(sum over the window of inputs times the conv weight);
2. q, k, v, beta and the decay g as in the layer (:mod:`hyperpar_gdn.ops.gdn.layer`);
3. one step of the gated delta rule from S (:func:`hyperpar_gdn.ops.gdn.naive.recurrent_gated_delta_rule`);
4. the gated norm and out_proj.

This equals running the whole layer over the prompt and the token (the reference the tests use),
and transformers' own cached step for ``Qwen3_5GatedDeltaNet``.

Legend: B batch, C conv channels, W conv width, H value heads, K/V head dims.
"""

from __future__ import annotations

from hyperpar_gdn.ops.gdn.kernels import decode_rule
from hyperpar_gdn.ops.gdn.layer import LayerDims, LayerWeights, finish, gates, head_dims, project, split_heads
from hyperpar_gdn.platform import Tensor, TensorOps

__all__ = ["gdn_decode_step"]


def gdn_decode_step(
    xp: TensorOps,
    w: LayerWeights,
    dims: LayerDims,
    x: Tensor,
    conv_BCW: Tensor,
    state_BHKV: Tensor,
    *,
    kernel: str = "native",
) -> tuple[Tensor, Tensor, Tensor]:
    """x ``[B, 1, hidden]`` (the next token's input), conv state ``[B, C, W]``, recurrent state
    ``[B, H, K, V]`` -> (output ``[B, 1, hidden]``, new conv state, new recurrent state).
    ``kernel``: ``"native"`` (step 3 above) or ``"fla"`` (fla's fused recurrent kernel,
    :mod:`hyperpar_gdn.ops.gdn.kernels`)."""
    b, t, _ = x.shape
    if t != 1:
        raise ValueError(
            f"a decoding step takes one token per row: x must be [B, 1, hidden]; got {tuple(x.shape)}"
        )
    width = dims.conv_kernel_size
    if tuple(conv_BCW.shape) != (b, dims.conv_dim, width):
        raise ValueError(
            f"conv state must be [B, C, W] = {(b, dims.conv_dim, width)}; got {tuple(conv_BCW.shape)}"
        )
    mixed, z, beta_logits, decay_logits = project(xp, w, x)
    window = xp.cat([conv_BCW[:, :, 1:], xp.cast(xp.swapaxes(mixed, 1, 2), xp.dtype(conv_BCW))], 2)
    weight = xp.cast(w.conv.reshape(dims.conv_dim, width), xp.dtype(window))
    conv_out = xp.silu(xp.sum(window * weight, -1, keepdim=True))  # [B, C, 1]
    q, k, v = split_heads(xp, xp.cast(xp.swapaxes(conv_out, 1, 2), xp.dtype(x)), **head_dims(dims))
    g, beta = gates(xp, beta_logits, decay_logits, w.a_log, w.dt_bias)
    o, state = decode_rule(q, k, v, g, beta, state_BHKV, kernel=kernel)
    return finish(xp, w, dims, xp.cast(o, xp.dtype(x)), z), window, state
