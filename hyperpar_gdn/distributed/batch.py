"""A batch cut into context-parallel shards, and the loss that makes them add up to one device's.

    shard = shard_for_context_parallel(mesh, input_ids, attention_mask=mask)   # whole batch in
    logits = model(**shard.model_inputs()).logits                               # [B, T/cp, V]
    loss = context_parallel_loss(logits, shard.labels, mesh)
    loss.backward()
    sync_context_parallel_grads(model, mesh)   # sum the gradient shares over the CP ranks

``layout="head_tail"`` cuts 2*cp pieces and gives rank r pieces r and 2cp-1-r
(:mod:`hyperpar_gdn.distributed.layout`); the model must have been parallelized with the same
``layout`` (``apply_context_parallel(..., layout=...)``), and refuses a batch cut for another.

A transformers Qwen3.5 model under ``apply_context_parallel`` gives the same loss as
``model(**shard.model_inputs(), labels=shard.labels).loss``.

Labels are shifted on the whole sequence before sharding (transformers' ``shift_labels``
convention): the label of the last token of rank r's shard is the first token of rank r+1's, and
no rank loses a token to the shift. The loss of a rank is the sum of its token losses divided by
the token count of the whole CP group, so the ranks' losses add up to the single-device mean and
their gradients, summed, to its gradient.

Legend: B batch, T whole sequence, T/cp a rank's shard, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hyperpar_gdn.distributed.layout import TokenLayout, layout_error
from hyperpar_gdn.distributed.mesh import as_cp_mesh
from hyperpar_gdn.ops.gdn.varlen import doc_starts_from_cu_seqlens
from hyperpar_gdn.ops.lm_loss import lm_loss_sum
from hyperpar_gdn.planning.plan import check_layout
from hyperpar_gdn.platform import Tensor, ops_for
from hyperpar_gdn.platform.base import IGNORE_INDEX

__all__ = [
    "ContextParallelBatch",
    "context_parallel_lm_loss",
    "context_parallel_loss",
    "shard_for_context_parallel",
]


@dataclass(frozen=True)
class ContextParallelBatch:
    """This rank's part of a batch: its tokens of every row (``layout``).

    Attributes:
        input_ids: ``[B, T/cp]``.
        position_ids: ``[B, T/cp]``, the global positions of the shard's tokens (contiguous:
            ``r*T/cp + t``).
        labels: ``[B, T/cp]``, the next token of the whole sequence (``-100`` after the last
            token, where the next token is padding or opens another packed document).
        attention_mask: ``[B, T/cp]`` shard of the padding mask, or None.
        cu_seqlens: packed documents: int ``[N+1]`` over the whole sequence (the same on every
            rank; pass it to ``HybridLM``), or None. For transformers' models ``position_ids``
            already restart at every document, which the model's hook reads.
    """

    input_ids: Tensor
    position_ids: Tensor
    labels: Tensor
    attention_mask: Tensor | None
    cu_seqlens: Tensor | None = None
    layout: str = "contiguous"

    def model_inputs(self) -> dict[str, Any]:
        """Keyword arguments of a transformers model's forward. Labels stay out: add
        ``labels=self.labels`` for the model's own loss (under ``apply_context_parallel`` this rank's
        term of the global mean), or use :func:`context_parallel_loss` on the logits. ``cp_layout``
        names the layout; the parallelized model checks it against its own."""
        inputs = {"input_ids": self.input_ids, "position_ids": self.position_ids, "cp_layout": self.layout}
        if self.attention_mask is not None:
            inputs["attention_mask"] = self.attention_mask
        return inputs


# Long for its docstring (24 of its 88 lines): the public entry point documents every argument.
def shard_for_context_parallel(
    mesh: Any,
    input_ids: Tensor,
    *,
    labels: Tensor | None = None,
    shift_labels: Tensor | None = None,
    attention_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    layout: str = "contiguous",
) -> ContextParallelBatch:
    """Cut a whole batch into this rank's context-parallel shard (no communication).

    Args:
        mesh: the 1-D CP mesh (e.g. ``mesh["cp"]``).
        input_ids: ``[B, T]`` int, the same on every rank of the mesh; T divisible by cp
            (by 2*cp for head_tail).
        labels: ``[B, T]`` int aligned with ``input_ids`` (token t's own id, ``-100`` to ignore),
            as transformers takes them; None: ``input_ids`` (language modelling).
        shift_labels: ``[B, T]`` int, labels already shifted (position t's target is the token
            after t, ``-100`` to ignore; transformers' ``shift_labels``): cut as they are, neither
            shifted nor masked at padding or document ends, so the caller keeps every label it
            has (such as the one after a window's last token). Not together with ``labels``.
        attention_mask: ``[B, T]`` (1 = token, 0 = padding) or None. Padding is never a label.
        position_ids: ``[B, T]``: transformers' packed convention (restarting at 0 for every
            document, as ``DataCollatorWithFlattening`` emits) or plain positions; None: ``0..T-1``.
        cu_seqlens: packed documents (B = 1), int ``[N+1]`` (fla's); with position_ids, both must
            describe the same documents.
        layout: ``"contiguous"`` (rank r gets tokens ``[r*T/cp, (r+1)*T/cp)``) or ``"head_tail"``
            (rank r gets pieces r and 2cp-1-r of 2*cp, concatenated). Documents and padding may
            cross pieces.

    Returns a :class:`ContextParallelBatch` whose labels are already shifted (predict token t+1
    at position t); no label crosses into another document.
    """
    cp_mesh = as_cp_mesh(mesh)
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    check_layout(layout)
    xp = ops_for(input_ids)
    shape = tuple(input_ids.shape)
    if len(shape) != 2:
        raise ValueError(f"input_ids must be the whole batch [B, T]; got shape {shape}")
    b, t = shape
    error = layout_error(layout, t, cp)
    if error is not None:
        raise ValueError(error)
    if labels is not None and shift_labels is not None:
        raise ValueError("pass labels (shifted here) or shift_labels (already shifted), not both")
    for name, tensor in (
        ("labels", labels),
        ("shift_labels", shift_labels),
        ("attention_mask", attention_mask),
        ("position_ids", position_ids),
    ):
        if tensor is not None and tuple(tensor.shape) != shape:
            raise ValueError(f"{name} must have input_ids' shape [B, T] = {shape}; got {tuple(tensor.shape)}")
    targets = input_ids if labels is None else labels
    # next token as the label of each position, IGNORE_INDEX after the last one
    shifted = xp.pad_dim(targets[:, 1:] - IGNORE_INDEX, 1, 0, 1) + IGNORE_INDEX
    if attention_mask is not None:
        next_is_token = xp.pad_dim(xp.cast(attention_mask[:, 1:] != 0, xp.dtype(shifted)), 1, 0, 1)
        shifted = (shifted - IGNORE_INDEX) * next_is_token + IGNORE_INDEX
    starts = _packed_starts(xp, b, t, position_ids, cu_seqlens)  # bool [T] or None
    cu = None
    if starts is not None:
        opens = np.append(starts[1:], False)  # the next token opens another document
        shifted = (shifted - IGNORE_INDEX) * xp.constant(~opens, like=shifted).reshape(1, t) + IGNORE_INDEX
        cu = xp.constant(np.append(np.flatnonzero(starts), t), like=input_ids)
        if position_ids is None:  # transformers' packed convention: 0 at every document start
            first = np.maximum.accumulate(np.where(starts, np.arange(t), 0))
            position_ids = xp.constant((np.arange(t) - first).reshape(1, t), like=input_ids)
    if position_ids is None:
        position_ids = xp.arange(t, like=input_ids).reshape(1, t) + input_ids * 0
    if shift_labels is not None:
        shifted = shift_labels
    tokens = TokenLayout.of(layout, [t // cp] * cp)

    def mine(x: Tensor) -> Tensor:
        return tokens.local(xp, x, rank, 1)

    return ContextParallelBatch(
        input_ids=mine(input_ids),
        position_ids=mine(position_ids),
        labels=mine(shifted),
        attention_mask=None if attention_mask is None else mine(attention_mask),
        cu_seqlens=cu,
        layout=layout,
    )


def _packed_starts(xp: Any, b: int, t: int, position_ids: Tensor | None, cu_seqlens: Tensor | None) -> Any:
    """bool ``[T]`` (numpy), True where a packed document starts, or None when not packed."""
    from_cu = None if cu_seqlens is None else doc_starts_from_cu_seqlens(cu_seqlens, seq_len=t)
    if cu_seqlens is not None and b != 1:
        raise ValueError(f"packed documents (cu_seqlens) need batch size B=1; got B={b}")
    if position_ids is None:
        return from_cu
    positions = xp.to_numpy(position_ids)
    restarts = np.diff(positions, axis=1) != 1
    if not restarts.any():
        return from_cu
    if b != 1:
        raise ValueError(f"packed documents (position_ids that restart) need batch size B=1; got B={b}")
    from_positions = np.concatenate([[True], restarts[0]])
    if from_cu is not None and not np.array_equal(from_cu, from_positions):
        raise ValueError(
            f"cu_seqlens starts documents at {np.flatnonzero(from_cu).tolist()}, position_ids at "
            f"{np.flatnonzero(from_positions).tolist()}"
        )
    return from_positions


def context_parallel_loss(logits: Tensor, labels: Tensor, mesh: Any) -> Tensor:
    """This rank's term of the global token-mean cross-entropy.

    Args:
        logits: ``[B, T/cp, V]`` this rank's logits.
        labels: ``[B, T/cp]`` shifted labels (``-100`` ignored), e.g. ``shard.labels``.
        mesh: the 1-D CP mesh; the token count is summed over it (one small all-reduce).

    Returns the sum of this rank's token losses over the number of labelled tokens of the whole
    CP group (fp32). Summed over the ranks it is the single-device mean; so are the gradients.
    """
    cp_mesh = as_cp_mesh(mesh)
    xp = ops_for(logits)
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"labels must be logits' [B, T/cp] = {tuple(logits.shape[:-1])}; got {tuple(labels.shape)}"
        )
    loss_sum = xp.cross_entropy_sum(logits, labels, ignore_index=IGNORE_INDEX)
    return loss_sum / _labelled_tokens(cp_mesh, labels, loss_sum)


def context_parallel_lm_loss(
    hidden_states: Tensor,
    lm_head_weight: Tensor,
    labels: Tensor,
    mesh: Any,
    *,
    chunk_tokens: int | None = None,
) -> Tensor:
    """:func:`context_parallel_loss` of ``hidden_states @ lm_head_weight^T`` without the logits.

    The same value and gradients (of the hidden states and the head weight) as
    ``context_parallel_loss(hidden_states @ lm_head_weight.T, labels, mesh)``, but the ``[B, T/cp, V]``
    logits are never held: the tokens are walked ``chunk_tokens`` at a time, forward and backward
    (:func:`hyperpar_gdn.ops.lm_loss.lm_loss_sum`). With transformers' models::

        text_model = model.model                       # Qwen3_5ForCausalLM's decoder
        hidden = text_model(**shard.model_inputs()).last_hidden_state          # [B, T/cp, C]
        loss = context_parallel_lm_loss(hidden, model.lm_head.weight, shard.labels, mesh)

    (``lm_head.weight`` is the embedding's weight when the model ties them.)

    Args:
        hidden_states: ``[B, T/cp, C]`` this rank's final hidden states (after the final norm).
        lm_head_weight: ``[V, C]``.
        labels: ``[B, T/cp]`` shifted labels (``-100`` ignored), e.g. ``shard.labels``.
        mesh: the 1-D CP mesh; the token count is summed over it (one small all-reduce).
        chunk_tokens: tokens per chunk; None: one chunk's fp32 logits take at most 256 MiB.

    Returns the sum of this rank's token losses over the number of labelled tokens of the whole
    CP group (fp32; fp64 for fp64 hidden states).
    """
    cp_mesh = as_cp_mesh(mesh)
    if len(tuple(hidden_states.shape)) != 3:
        raise ValueError(f"hidden_states must be [B, T/cp, C]; got shape {tuple(hidden_states.shape)}")
    loss_sum = lm_loss_sum(hidden_states, lm_head_weight, labels, chunk_tokens=chunk_tokens)
    return loss_sum / _labelled_tokens(cp_mesh, labels, loss_sum)


def _labelled_tokens(cp_mesh: Any, labels: Tensor, like: Tensor) -> Tensor:
    """The number of labels that are not ``-100`` over the whole CP group (0-d, ``like``'s dtype)."""
    xp = ops_for(like)
    count = xp.sum(xp.cast(labels != IGNORE_INDEX, xp.dtype(like)), (0, 1))
    if cp_mesh.size() > 1:
        count = cp_mesh.platform.collectives.all_reduce_sum(count.reshape(1), cp_mesh.get_group()).reshape(())
    return count
