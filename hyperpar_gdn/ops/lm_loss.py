"""The language-model loss from the final hidden states, without ever holding the logits.

    loss_sum = lm_loss_sum(hidden_BTC, head_VC, labels_BT)            # chunked, the fast path
    loss_sum = lm_loss_sum_reference(hidden_BTC, head_VC, labels_BT)  # cross-entropy over logits

Both return the sum of token cross-entropies ``-log softmax(h W^T)[label]`` over the tokens whose
label is not ``ignore_index`` (fp32; fp64 for fp64 hidden states). The reference builds the whole
``[N, V]`` logits (1 GB per 1K tokens in fp32 with Qwen3.5's 248,320-token vocabulary; autograd
keeps them and their gradient). The chunked path walks the tokens ``chunk_tokens`` at a time: each
chunk's logits, log-sum-exp and target logit are formed in fp32 and dropped; the backward
recomputes each chunk's logits from the saved hidden states and head weight and forms that chunk's
gradient of the hidden states and its share of the head weight's gradient (accumulated in fp32).
Peak memory beyond the inputs: three ``[chunk_tokens, V]`` fp32 tensors (in the backward) and one
``[V, C]`` fp32 accumulator. Cost: one more ``[n, C] x [C, V]`` matmul per chunk than the logits path (the
recomputation).

Precision: the matmuls run in the hidden states' dtype (a bf16 model multiplies in bf16, the head
weight cast once per call), everything after them in fp32.

Legend: N tokens (all leading dims of the hidden states flattened), C hidden size, V vocabulary,
n tokens of one chunk.
"""

from __future__ import annotations

import math

import numpy as np

from hyperpar_gdn.platform import Tensor, TensorOps, ops_for
from hyperpar_gdn.platform.base import IGNORE_INDEX

# One chunk's fp32 logits stay within this (the backward holds up to three such tensors).
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
    _check(hidden, weight, labels, ignore_index)
    vocab = int(weight.shape[0])
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(vocab)
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be a positive int or None; got {chunk_tokens!r}")
    xp = ops_for(hidden)
    num_tokens = math.prod(int(d) for d in hidden.shape[:-1])
    sizes = [chunk_tokens] * (num_tokens // chunk_tokens)
    if num_tokens % chunk_tokens or not sizes:
        sizes.append(num_tokens % chunk_tokens)
    vocab_ids = xp.arange(vocab, like=hidden).reshape(1, vocab)
    labels_n = xp.cast(labels.reshape(-1), xp.dtype(vocab_ids))
    label_chunks = xp.split(labels_n, sizes, 0)
    shape = tuple(hidden.shape)

    def forward(h: Tensor, w: Tensor) -> tuple[tuple[Tensor], tuple[Tensor, Tensor]]:
        h_NC = h.reshape(num_tokens, shape[-1])
        return (_forward(xp, h_NC, w, sizes, label_chunks, ignore_index),), (h_NC, w)

    def backward(saved: tuple[Tensor, ...], d_loss: Tensor) -> tuple[Tensor, Tensor]:
        h_NC, w = saved
        dh_NC, dw = _backward(xp, h_NC, w, d_loss, sizes, label_chunks, vocab_ids, ignore_index)
        return dh_NC.reshape(shape), dw

    (loss,) = xp.custom_vjp(forward, backward, hidden, weight)
    return loss


def _forward(
    xp: TensorOps, h_NC: Tensor, w_VC: Tensor, sizes: list[int], label_chunks: list[Tensor], ignore_index: int
) -> Tensor:
    """The loss sum, chunk by chunk (autograd is off here)."""
    w_VC = xp.cast(w_VC, xp.dtype(h_NC))
    total = None
    for h_nC, labels_n in zip(xp.split(h_NC, sizes, 0), label_chunks, strict=True):
        logits_nV = xp.linear(h_nC, w_VC)
        loss = xp.cross_entropy_sum(
            xp.cast(logits_nV, xp.compute_dtype(logits_nV)), labels_n, ignore_index=ignore_index
        )
        total = loss if total is None else total + loss
    return total


def _backward(
    xp: TensorOps,
    h_NC: Tensor,
    w: Tensor,
    d_loss: Tensor,
    sizes: list[int],
    label_chunks: list[Tensor],
    vocab_ids: Tensor,
    ignore_index: int,
) -> tuple[Tensor, Tensor]:
    """(d hidden ``[N, C]``, d weight ``[V, C]``): per chunk, dlogits = d_loss (softmax - onehot)
    on the labelled tokens, recomputed from the chunk's logits."""
    dtype = xp.dtype(h_NC)
    w_VC = xp.cast(w, dtype)
    acc = xp.compute_dtype(h_NC)  # fp32 (fp64 for fp64)
    g = xp.cast(d_loss, acc)
    dw_VC = xp.zeros(tuple(w.shape), like=g)
    dh_parts = []
    for h_nC, labels_n in zip(xp.split(h_NC, sizes, 0), label_chunks, strict=True):
        labels_n1 = labels_n.reshape(-1, 1)
        keep_n1 = xp.cast(labels_n1 != ignore_index, acc) * g
        # names are rebound as soon as a [n, V] tensor is used up: at most three live at a time
        dlogits_nV = xp.softmax(xp.cast(xp.linear(h_nC, w_VC), acc), -1)
        dlogits_nV = dlogits_nV - xp.cast(vocab_ids == labels_n1, acc)
        dlogits_nV = xp.cast(dlogits_nV * keep_n1, dtype)
        dh_parts.append(xp.matmul(dlogits_nV, w_VC))
        dw_VC = dw_VC + xp.cast(xp.matmul(xp.swapaxes(dlogits_nV, 0, 1), h_nC), acc)
    return xp.cat(dh_parts, 0), xp.cast(dw_VC, xp.dtype(w))


def _check(hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int) -> None:
    h_shape, w_shape, l_shape = tuple(hidden.shape), tuple(weight.shape), tuple(labels.shape)
    if len(h_shape) < 2:
        raise ValueError(f"hidden must be [..., C] with at least one token dim; got shape {h_shape}")
    if len(w_shape) != 2 or w_shape[1] != h_shape[-1]:
        raise ValueError(
            f"the head weight must be [V, C] with C = hidden's {h_shape[-1]}; got shape {w_shape}"
        )
    if l_shape != h_shape[:-1]:
        raise ValueError(f"labels must have hidden's leading shape {h_shape[:-1]}; got {l_shape}")
    values = np.asarray(ops_for(labels).to_numpy(labels))
    bad = values[(values != ignore_index) & ((values < 0) | (values >= w_shape[0]))]
    if bad.size:
        raise ValueError(
            f"labels must be in [0, V={w_shape[0]}) or ignore_index={ignore_index}; got {bad[:5].tolist()}"
        )
