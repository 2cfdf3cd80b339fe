"""The non-mixer parts of a decoder LM as stages of tensor maths, on any framework: RMSNorm (plain,
and Qwen3.5's zero-centred one), the SwiGLU MLP, the pre-norm residual block and the LM head.

Written once against the platform's :class:`~hyperpar_gdn.platform.TensorOps`; the torch and
MindSpore modules (``hyperpar_gdn.models`` and ``hyperpar_gdn.models.mindspore``) hold the
parameters and call these.

Legend: B batch, T tokens, C hidden size, I MLP width, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hyperpar_gdn.ops.projections import Projection, WeightLinear
from hyperpar_gdn.ops.rms_norm_vjp import written_rms_norm
from hyperpar_gdn.platform import Tensor, TensorOps

__all__ = ["decoder_block", "lm_logits", "rms_norm", "sparse_moe", "swiglu", "swiglu_of"]


def rms_norm(xp: TensorOps, x: Tensor, weight: Tensor, eps: float, *, zero_centred: bool = False) -> Tensor:
    """RMSNorm over the last dim, normalised in the compute dtype (fp32, fp64 for fp64 input);
    the result has x's dtype.

    - plain: ``weight * (x / rms(x))`` (the product in x's dtype, as ours always did);
    - ``zero_centred`` (Qwen3.5's ``Qwen3_5RMSNorm``): ``(x / rms(x)) * (1 + weight)`` in the
      compute dtype, then cast; its weight starts at zeros.

    x ``[..., D]``, weight ``[D]``."""
    if xp.prefers_written_backward:
        return written_rms_norm(xp, x, weight, eps, zero_centred=zero_centred)
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
    return swiglu_of(xp, x, WeightLinear(gate), WeightLinear(up), WeightLinear(down))


def swiglu_of(xp: TensorOps, x: Tensor, gate: Projection, up: Projection, down: Projection) -> Tensor:
    """:func:`swiglu` of the projections themselves (an MLP's modules, called as the model holds
    them): ``[..., C] -> [..., I]`` for gate and up, ``[..., I] -> [..., C]`` for down."""
    return down(xp.silu(gate(x)) * up(x))


def sparse_moe(
    xp: TensorOps,
    x: Tensor,
    *,
    router: Tensor,
    experts: Sequence[tuple[Tensor, Tensor, Tensor]],
    top_k: int,
    shared: tuple[Tensor, Tensor, Tensor],
    shared_gate: Tensor,
) -> Tensor:
    """Qwen3.5-MoE's sparse block (transformers' ``Qwen3_5MoeSparseMoeBlock``) on x ``[..., C]``.

    Router probabilities ``softmax(x @ router.T)`` (router ``[E, C]``, in the compute dtype); each
    token keeps its ``top_k`` experts with their probabilities renormalised to sum to 1; the
    output is the weighted sum of those experts' SwiGLU outputs plus the shared expert's SwiGLU
    output times ``sigmoid(x @ shared_gate.T)`` (shared_gate ``[1, C]``). ``experts`` and
    ``shared`` are (gate, up, down) weights as for :func:`swiglu`.

    Every expert runs on every token and is weighted by zero where not chosen: exact, and right
    for few experts; a model with hundreds wants a grouped (token-sorted) kernel instead."""
    logits = xp.linear(x, router)
    probs = xp.softmax(xp.cast(logits, xp.compute_dtype(logits)), -1)  # [..., E]
    chosen = probs * xp.cast(xp.top_k_mask(probs, top_k), xp.dtype(probs))
    weights = xp.cast(chosen / xp.sum(chosen, -1, keepdim=True), xp.dtype(x))
    routed = None
    for e, (gate, up, down) in enumerate(experts):
        term = swiglu(xp, x, gate, up, down) * weights[..., e : e + 1]
        routed = term if routed is None else routed + term
    return routed + xp.sigmoid(xp.linear(x, shared_gate)) * swiglu(xp, x, *shared)


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
