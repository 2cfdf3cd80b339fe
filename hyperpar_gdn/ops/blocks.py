"""The non-mixer parts of a decoder LM as stages of tensor maths, on any framework: RMSNorm (plain,
and Qwen3.5's zero-centred one), the SwiGLU MLP, the pre-norm residual block and the LM head.

Written once against the platform's :class:`~hyperpar_gdn.platform.TensorOps`; the torch and
MindSpore modules (``hyperpar_gdn.models`` and ``hyperpar_gdn.models.mindspore``) hold the
parameters and call these.

Legend: B batch, T tokens, C hidden size, I MLP width, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable

from hyperpar_gdn.platform import Tensor, TensorOps

__all__ = ["decoder_block", "lm_logits", "rms_norm", "swiglu"]


def rms_norm(xp: TensorOps, x: Tensor, weight: Tensor, eps: float, *, zero_centred: bool = False) -> Tensor:
    """RMSNorm over the last dim, normalised in the compute dtype (fp32, fp64 for fp64 input);
    the result has x's dtype.

    - plain: ``weight * (x / rms(x))`` (the product in x's dtype, as ours always did);
    - ``zero_centred`` (Qwen3.5's ``Qwen3_5RMSNorm``): ``(x / rms(x)) * (1 + weight)`` in the
      compute dtype, then cast; its weight starts at zeros.

    x ``[..., D]``, weight ``[D]``."""
    dtype = xp.dtype(x)
    x_ct = xp.cast(x, xp.compute_dtype(x))
    mean_sq = xp.sum(x_ct * x_ct, -1, keepdim=True) / xp.scalar(float(x.shape[-1]), x_ct)
    normed = x_ct * xp.rsqrt(mean_sq + xp.scalar(eps, x_ct))
    if zero_centred:
        w_ct = xp.cast(weight, xp.dtype(x_ct))
        return xp.cast(normed * (w_ct + xp.scalar(1.0, w_ct)), dtype)
    return weight * xp.cast(normed, dtype)


def swiglu(xp: TensorOps, x: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> Tensor:
    """``down(silu(gate(x)) * up(x))``: x ``[..., C]``, gate and up ``[I, C]``, down ``[C, I]``."""
    return xp.linear(xp.silu(xp.linear(x, gate)) * xp.linear(x, up), down)


def decoder_block(
    x_BTC: Tensor,
    *,
    mixer: Callable[[Tensor], Tensor],
    mlp: Callable[[Tensor], Tensor],
    input_norm: Callable[[Tensor], Tensor],
    post_norm: Callable[[Tensor], Tensor],
) -> Tensor:
    """Pre-norm residual block: ``x + mixer(input_norm(x))``, then ``+ mlp(post_norm(.))``."""
    x_BTC = x_BTC + mixer(input_norm(x_BTC))
    return x_BTC + mlp(post_norm(x_BTC))


def lm_logits(xp: TensorOps, hidden_BTC: Tensor, head: Tensor) -> Tensor:
    """Logits ``[B, T, V]`` of the final hidden states and the head weight ``[V, C]`` (the
    embedding's when tied), in fp32 at least (fp64 for an fp64 model)."""
    logits_BTV = xp.linear(hidden_BTC, head)
    return xp.cast(logits_BTV, xp.compute_dtype(logits_BTV))
