"""The language-model loss from the final hidden states, without ever holding the logits.

    loss_sum = lm_loss_sum(hidden_BTC, head_VC, labels_BT)            # chunked, the fast path
    loss_sum = lm_loss_sum_reference(hidden_BTC, head_VC, labels_BT)  # cross-entropy over logits

Both return the sum of token cross-entropies ``lse(h W^T) - (h W^T)[label]`` over the tokens
whose label is not ``ignore_index`` (fp32; fp64 for fp64 hidden states). The reference builds the
whole ``[N, V]`` logits (1 GB per 1K tokens in fp32 with Qwen3.5's 248,320-token vocabulary;
autograd keeps them and their gradient). The chunked path first drops the tokens without a loss
(their gradient is zero), then walks the rest ``chunk_tokens`` at a time:

- forward: a chunk's logits ``[n, V]`` (one matmul), their log-sum-exp ``[n]`` and the target
  logits, read at ``n`` flat positions of the same logits (no one-hot, no log-softmax tensor); the
  log-sum-exp of every token is kept (``[N]`` fp32, 4 bytes a token) for the backward;
- backward: the chunk's logits again (the one recomputation, inherent to not keeping them),
  ``P = exp(logits - lse)`` with the saved log-sum-exp (no second max and normaliser), then
  ``dh = g (P W - W[label])`` and ``dW += P^T h``; the one-hot part of ``dW`` (``-g h`` added to
  the rows of the labels) is one ``[N, C]`` row update after the loop, and the upstream gradient
  ``g`` scales ``[n, C]`` and ``[V, C]`` tensors, never an ``[n, V]`` one.

Cost per token with a loss, forward + backward (C hidden, V vocabulary):

=================  ================  ==============================================
path               matmul FLOPs      passes over an ``[n, V]`` fp32 tensor
=================  ================  ==============================================
logits             6 C V             log-softmax 4, its backward 3 (whole ``[N, V]``)
chunked, before    8 C V             forward 4, backward softmax 3 + one-hot 4 + scale 1
chunked, now       8 C V             forward 4 (max, shift, exp, sum), backward 2 (shift, exp)
=================  ================  ==============================================

(a pass reads or writes V values per token; the fp32 casts are free in fp32 models). With Qwen3.5's
head (C = 5120) the matmuls dominate and the recompute costs 8/6 of the logits path's FLOPs; with
the benchmark's C = 256 a matmul is 512 FLOPs per logit, so the passes matter as much.

Chunk size: no block of logits fits a cache (one token's row is ~1 MB at V = 248K, beyond any L2),
so every pass streams from memory whatever ``n`` is, and ``n`` only trades peak memory against the
per-chunk fixed cost and matmul efficiency (rows >= ~256 reach the large-matmul rate on CPUs). The
rule: the largest ``n`` whose fp32 logits take at most :data:`DEFAULT_CHUNK_BYTES` (256 MiB: 270
tokens at V = 248,320). Peak memory beyond the inputs: two ``[n, V]`` fp32 tensors (each step
rebinds one name; before: three in the backward) and, in a bf16 model, the bf16 logits and
probabilities; the ``[V, C]`` fp32 accumulator and ``[N]`` fp32 log-sum-exps.

``torch.compile`` of the chunk body (the shift and exp, and the forward's log-sum-exp) was tried on
CPU: inductor compiles it (with the system's C compiler, ~30 s for the first shape and again for
each new chunk length unless compiled dynamic) and agrees with eager to one rounding (2e-16
relative in fp64, 1e-7 in fp32), so exactness would hold. It is not used: this module names no
framework (a compiled body would be a torch-only platform function), it fuses only the two
elementwise passes left, not the matmuls, and whether it wins could not be timed on the loaded
machine this was written on.

Precision: the matmuls run in the hidden states' dtype (a bf16 model multiplies in bf16, the head
weight cast once per call), everything after them in fp32.

Legend: N tokens (all leading dims of the hidden states flattened), C hidden size, V vocabulary,
n tokens of one chunk.
"""

from __future__ import annotations

import numpy as np

from hyperpar_gdn.platform import Tensor, TensorOps, ops_for
from hyperpar_gdn.platform.base import IGNORE_INDEX

# One chunk's fp32 logits stay within this (forward and backward hold at most two such tensors).
DEFAULT_CHUNK_BYTES = 256 * 2**20

__all__ = ["DEFAULT_CHUNK_BYTES", "default_chunk_tokens", "lm_loss_sum", "lm_loss_sum_reference"]


def default_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk whose fp32 logits take at most :data:`DEFAULT_CHUNK_BYTES` (270 tokens,
    256 MiB, for a 248,320-token vocabulary; at least 1)."""
    return max(1, DEFAULT_CHUNK_BYTES // (4 * int(vocab_size)))


def lm_loss_sum_reference(
    hidden: Tensor, weight: Tensor, labels: Tensor, *, ignore_index: int = IGNORE_INDEX
) -> Tensor:
    """Cross-entropy over the whole logits: hidden ``[..., C]``, weight ``[V, C]``, labels ``[...]``
    int. The readable reference of :func:`lm_loss_sum` (same checks, same value)."""
    _check(hidden, weight, labels, ignore_index)
    xp = ops_for(hidden)
    logits = xp.linear(hidden, xp.cast(weight, xp.dtype(hidden)))
    return xp.cross_entropy_sum(xp.cast(logits, xp.compute_dtype(logits)), labels, ignore_index=ignore_index)


def lm_loss_sum(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    chunk_tokens: int | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> Tensor:
    """The sum of token cross-entropies of ``hidden @ weight^T``, ``chunk_tokens`` tokens at a time.

    Args:
        hidden: ``[..., C]`` final hidden states (after the final norm), e.g. ``[B, T, C]``.
        weight: ``[V, C]`` the LM head (the embedding's weight when tied).
        labels: ``hidden.shape[:-1]`` int, the target of each token; ``ignore_index`` adds nothing.
        chunk_tokens: tokens per chunk (any positive int; the last chunk takes the rest); None:
            :func:`default_chunk_tokens` of V.
        ignore_index: the label of tokens without a loss.

    Returns a 0-d tensor (fp32; fp64 for fp64 hidden states) with gradients for ``hidden`` and
    ``weight`` equal to :func:`lm_loss_sum_reference`'s.

    Example:
        >>> h, w = torch.randn(2, 8, 16, requires_grad=True), torch.randn(100, 16, requires_grad=True)
        >>> lm_loss_sum(h, w, torch.randint(0, 100, (2, 8)), chunk_tokens=5).backward()
    """
    labels_N = _check(hidden, weight, labels, ignore_index)
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(int(weight.shape[0]))
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be a positive int or None; got {chunk_tokens!r}")
    xp = ops_for(hidden)
    shape = tuple(hidden.shape)
    tokens = _Tokens.of(labels_N, ignore_index, chunk_tokens)

    def forward(h: Tensor, w: Tensor) -> tuple[tuple[Tensor], tuple[Tensor, ...]]:
        h_NC = h.reshape(len(labels_N), shape[-1])
        loss, lse_M = _forward(xp, h_NC, w, tokens)
        return (loss,), (h_NC, w, lse_M)

    def backward(saved: tuple[Tensor, ...], d_loss: Tensor) -> tuple[Tensor, Tensor]:
        h_NC, w, lse_M = saved
        dh_NC, dw = _backward(xp, h_NC, w, lse_M, d_loss, tokens)
        return dh_NC.reshape(shape), dw

    (loss,) = xp.custom_vjp(forward, backward, hidden, weight)
    return loss


class _Tokens:
    """The tokens with a loss, chunked (host-side numpy, fixed before the forward): ``kept`` ``[M]``
    their positions among the N tokens, ``targets`` ``[M]`` their labels, ``sizes`` the chunk
    lengths (sum M), ``flat`` per chunk the flat positions ``row * V + label`` of the targets in
    its ``[n, V]`` logits (filled by :meth:`flat_targets`)."""

    def __init__(self, num_tokens: int, kept: np.ndarray, targets: np.ndarray, sizes: list[int]) -> None:
        self.num_tokens, self.kept, self.targets, self.sizes = num_tokens, kept, targets, sizes

    @classmethod
    def of(cls, labels_N: np.ndarray, ignore_index: int, chunk_tokens: int) -> _Tokens:
        kept = np.flatnonzero(labels_N != ignore_index)
        m = len(kept)
        sizes = [chunk_tokens] * (m // chunk_tokens) + ([m % chunk_tokens] if m % chunk_tokens else [])
        return cls(len(labels_N), kept, labels_N[kept].astype(np.int64), sizes)

    @property
    def all_kept(self) -> bool:
        return len(self.kept) == self.num_tokens

    def chunks(self) -> list[tuple[int, int]]:
        """(start, stop) of each chunk among the M kept tokens."""
        stops = np.cumsum(self.sizes, dtype=np.int64).tolist()
        return list(zip([0, *stops], stops, strict=False))

    def flat_targets(self, start: int, stop: int, vocab: int) -> np.ndarray:
        return np.arange(stop - start, dtype=np.int64) * vocab + self.targets[start:stop]


def _kept_rows(xp: TensorOps, h_NC: Tensor, tokens: _Tokens) -> Tensor:
    """``[M, C]`` the hidden states of the tokens with a loss."""
    return h_NC if tokens.all_kept else xp.take(h_NC, tokens.kept, 0)


def _forward(xp: TensorOps, h_NC: Tensor, w_VC: Tensor, tokens: _Tokens) -> tuple[Tensor, Tensor]:
    """(the loss sum, ``[M]`` the log-sum-exp of each kept token's logits), chunk by chunk
    (autograd is off here)."""
    acc = xp.compute_dtype(h_NC)
    vocab = int(w_VC.shape[0])
    w_VC = xp.cast(w_VC, xp.dtype(h_NC))
    h_MC = _kept_rows(xp, h_NC, tokens)
    total = xp.scalar(0.0, like=xp.cast(h_NC, acc)) if not tokens.sizes else None
    lse_parts = [xp.zeros((0,), like=total)] if total is not None else []
    for start, stop in tokens.chunks():
        # one name for the [n, V] tensors, rebound at every step: at most two live at a time
        logits_nV = xp.cast(xp.linear(h_MC[start:stop], w_VC), acc)
        top_n1 = xp.amax(logits_nV, -1, keepdim=True)
        target_n = xp.take(logits_nV.reshape(-1), tokens.flat_targets(start, stop, vocab), 0)
        logits_nV = logits_nV - top_n1
        logits_nV = xp.exp(logits_nV)
        lse_n = (xp.log(xp.sum(logits_nV, -1, keepdim=True)) + top_n1).reshape(-1)
        loss = xp.sum(lse_n - target_n, 0)
        total = loss if total is None else total + loss
        lse_parts.append(lse_n)
    return total, lse_parts[0] if len(lse_parts) == 1 else xp.cat(lse_parts, 0)


def _backward(
    xp: TensorOps, h_NC: Tensor, w: Tensor, lse_M: Tensor, d_loss: Tensor, tokens: _Tokens
) -> tuple[Tensor, Tensor]:
    """(d hidden ``[N, C]``, d weight ``[V, C]``): per chunk ``P = exp(logits - lse)``,
    ``dh = g (P W - W[label])``, ``dW += P^T h``; then ``dW -= h`` at the label rows, times g."""
    dtype = xp.dtype(h_NC)
    w_VC = xp.cast(w, dtype)
    acc = xp.compute_dtype(h_NC)  # fp32 (fp64 for fp64)
    g = xp.cast(d_loss, acc)
    h_MC = _kept_rows(xp, h_NC, tokens)
    w_acc = xp.cast(w, acc)
    dw_VC = xp.zeros(tuple(w.shape), like=g)
    dh_parts = []
    for start, stop in tokens.chunks():
        h_nC = h_MC[start:stop]
        probs_nV = xp.cast(xp.linear(h_nC, w_VC), acc)  # rebound as in the forward: two [n, V] at most
        probs_nV = probs_nV - lse_M[start:stop].reshape(-1, 1)
        probs_nV = xp.cast(xp.exp(probs_nV), dtype)
        dh_nC = xp.cast(xp.matmul(probs_nV, w_VC), acc) - xp.take(w_acc, tokens.targets[start:stop], 0)
        dh_parts.append(xp.cast(dh_nC * g, dtype))
        dw_VC = dw_VC + xp.cast(xp.matmul(xp.swapaxes(probs_nV, 0, 1), h_nC), acc)
    if dh_parts:
        dw_VC = xp.add_rows(dw_VC, tokens.targets, -xp.cast(h_MC, acc))
    dw_VC = xp.cast(dw_VC * g, xp.dtype(w))
    dh_MC = (dh_parts[0] if len(dh_parts) == 1 else xp.cat(dh_parts, 0)) if dh_parts else None
    if tokens.all_kept and dh_MC is not None:
        return dh_MC, dw_VC
    return _scatter_rows(xp, dh_MC, tokens, h_NC), dw_VC


def _scatter_rows(xp: TensorOps, dh_MC: Tensor | None, tokens: _Tokens, h_NC: Tensor) -> Tensor:
    """``[N, C]``: the kept tokens' rows at their positions, zeros (exactly) elsewhere."""
    zeros = xp.zeros(tuple(h_NC.shape), like=h_NC)
    return zeros if dh_MC is None else xp.add_rows(zeros, tokens.kept, dh_MC)


def _check(hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int) -> np.ndarray:
    """Raise on a bad shape or label; return the labels ``[N]`` as numpy."""
    h_shape, w_shape, l_shape = tuple(hidden.shape), tuple(weight.shape), tuple(labels.shape)
    if len(h_shape) < 2:
        raise ValueError(f"hidden must be [..., C] with at least one token dim; got shape {h_shape}")
    if len(w_shape) != 2 or w_shape[1] != h_shape[-1]:
        raise ValueError(
            f"the head weight must be [V, C] with C = hidden's {h_shape[-1]}; got shape {w_shape}"
        )
    if l_shape != h_shape[:-1]:
        raise ValueError(f"labels must have hidden's leading shape {h_shape[:-1]}; got {l_shape}")
    values = np.asarray(ops_for(labels).to_numpy(labels)).reshape(-1)
    bad = values[(values != ignore_index) & ((values < 0) | (values >= w_shape[0]))]
    if bad.size:
        raise ValueError(
            f"labels must be in [0, V={w_shape[0]}) or ignore_index={ignore_index}; got {bad[:5].tolist()}"
        )
    return values
