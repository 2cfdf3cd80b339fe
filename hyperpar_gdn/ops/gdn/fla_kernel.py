"""fla's Triton kernels as the local GDN kernel (torch tensors; see :mod:`.kernels`).

- :func:`plain_call`: ``chunk_gated_delta_rule`` on whole sequences (packed documents as fla's
  ``cu_seqlens``, B = 1, one initial and final state per document).
- :func:`shard_call`: a shard of a state mode in one widened call (docs/maths.md): values
  [v | 0] (V + K columns) from the initial state [0 | I] give, per token, the outputs of a zero
  entering state (the V columns) and Q_eff (the K columns), and as final state the summary
  [S_ext | M]. The summary goes to the exchange, which returns the entering state S_in; then
  o = o0 + Q_eff S_in. Backward: dS_in = Q_eff^T do goes to the exchange, which returns dS_out,
  the gradient of the state leaving the shard; [dS_out | dS_out S_in^T] is the gradient of the
  final state, which fla's own backward takes with that of the outputs.
- :func:`recurrent_call`: ``fused_recurrent_gated_delta_rule`` for one decode step.

Packed documents in a shard: the rows (fragments, B = 1 each) become one packed row cut at the
row ends and at every document start; a piece that begins a row without a document start is
entered by [0 | I] (it continues a document from another rank), every other piece by zeros. The
row's summary is the final state of its last piece.

States and summaries are fp32; q, k, v, beta keep their dtype (bf16 as fla takes it), g is fp32.
fla's ``cu_seqlens_cpu`` is given beside ``cu_seqlens`` so that fla reads the bounds from the host.

A state mode's calls (plain and widened, on every rank of a chain) run fla's Triton kernel itself,
past fla's backend dispatch: a backend that serves only some widths (FlashQLA: V = 128 on
Hopper/Blackwell) would take the plain calls and leave the widened ones (V + K columns) to Triton,
so the ranks of one chain would run different kernels. Whole sequences (:func:`plain_call`) take
whatever backend fla dispatches to.

Legend: R rows (batch or fragments), T tokens per row, Hk q/k heads, H value heads, K/V head dims,
P pieces.
"""

from __future__ import annotations

import inspect
from collections import Counter
from typing import Any

import numpy as np

from hyperpar_gdn.ops.gdn.onepass import StateExchange
from hyperpar_gdn.ops.gdn.varlen import Documents
from hyperpar_gdn.platform import Tensor, ops_for

# fla kernel calls of this process by kind ("chunk": a plain call, "widened": a state mode's one
# pass, "recurrent": a decode step); tests read and reset it.
FLA_CALLS: Counter[str] = Counter()


def _fla(*, dispatched: bool = True):
    """fla's chunk and fused recurrent functions. ``dispatched=False``: the chunk function past
    fla's backend dispatch, i.e. its Triton kernel whatever other backend is installed (a state
    mode's calls, :func:`shard_call`)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    chunk = chunk_gated_delta_rule if dispatched else inspect.unwrap(chunk_gated_delta_rule)
    return chunk, fused_recurrent_gated_delta_rule


def _bounds(cu_seqlens: Any, like: Tensor, docs: Documents | None, tag: Any) -> dict[str, Any]:
    """fla's ``cu_seqlens`` on the inputs' device and ``cu_seqlens_cpu``, from host ints; made once
    and kept in ``docs`` (under ``tag``), the documents they come from, where given: the later
    layers of a forward copy nothing."""
    if cu_seqlens is None:
        return {}
    import torch

    def make() -> dict[str, Any]:
        xp = ops_for(like)
        host = xp.to_numpy(cu_seqlens) if xp.is_tensor(cu_seqlens) else cu_seqlens
        cpu = torch.from_numpy(np.array(host, dtype=np.int64))
        return {"cu_seqlens": cpu.to(like.device), "cu_seqlens_cpu": cpu}

    return make() if docs is None else docs.kept(("fla bounds", tag, str(like.device)), make)


def _call(
    kind: str,
    q,
    k,
    v,
    g,
    beta,
    *,
    dispatched: bool,
    cu_seqlens: Any = None,
    docs: Documents | None = None,
    initial_state=None,
    final_state=False,
):
    chunk, _ = _fla(dispatched=dispatched)
    FLA_CALLS[kind] += 1
    xp = ops_for(q)
    if initial_state is not None:
        initial_state = xp.cast(initial_state, xp.compute_dtype(q))
    return chunk(
        q,
        k,
        v,
        g,
        beta,
        initial_state=initial_state,
        output_final_state=final_state,
        use_qk_l2norm_in_kernel=True,
        **_bounds(cu_seqlens, q, docs, (kind, dispatched)),
    )


def plain_call(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    cu_seqlens: Any = None,
    docs: Documents | None = None,
    initial_state: Tensor | None = None,
    final_state: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """fla's chunk kernel: q, k ``[B, T, Hk, K]``, v ``[B, T, H, V]``, g, beta ``[B, T, H]`` ->
    (o ``[B, T, H, V]``, the final state(s) ``[B or N, H, K, V]`` fp32 or None). ``docs``: the
    documents ``cu_seqlens`` bounds, which keep its device copy for the forward's later calls."""
    o, s = _call(
        "chunk",
        q,
        k,
        v,
        g,
        beta,
        dispatched=True,
        cu_seqlens=cu_seqlens,
        docs=docs,
        initial_state=initial_state,
        final_state=final_state,
    )
    return o, (s if final_state else None)


def recurrent_call(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor
) -> tuple[Tensor, Tensor]:
    """fla's fused recurrent kernel for one token per row: (o ``[B, 1, H, V]``, the new state fp32)."""
    _, recurrent = _fla()
    FLA_CALLS["recurrent"] += 1
    xp = ops_for(q)
    return recurrent(
        q,
        k,
        v,
        g=g,
        beta=beta,
        initial_state=xp.cast(state, xp.compute_dtype(q)),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )


def _pieces(starts: np.ndarray, widened: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The packed row of the rows of ``starts`` (bool ``[rows, T]``) cut at row ends and document
    starts: (cu ``[P+1]``, entered ``[P]`` bool: the piece is entered by the row's S_in, last
    ``[rows]``: each row's last piece)."""
    rows, seq_len = starts.shape
    cuts = set(range(0, rows * seq_len, seq_len)) | {int(i) for i in np.flatnonzero(starts.reshape(-1))}
    cu = np.array(sorted(cuts | {rows * seq_len}), dtype=np.int64)
    begins = cu[:-1]
    entered = (begins % seq_len == 0) & ~starts.reshape(-1)[begins] & widened
    last = np.searchsorted(cu, np.arange(1, rows + 1) * seq_len) - 1
    return cu, entered, last


def _exchange_step(
    exchange: StateExchange, o0: Tensor, s_ext: Tensor, q_eff: Tensor | None, m: Tensor | None
):
    """o = o0 + Q_eff S_in with S_in from ``exchange`` (differentiable: dS_in goes to the exchange,
    dS_out comes back as the gradient of S_ext and, times S_in^T, of M). Shapes: o0 ``[R, T, H,
    V]``, q_eff ``[R, T, H, K]``, s_ext ``[R, H, K, V]``, m ``[R, H, K, K]``."""
    xp = ops_for(o0)

    def heads_first(x: Tensor) -> Tensor:  # [R, T, H, D] <-> [R, H, T, D]
        return xp.permute(x, (0, 2, 1, 3))

    if q_eff is None:

        def forward(o0: Tensor, s_ext: Tensor):
            exchange.forward(s_ext, None)
            return (o0,), ()

        def backward(saved, do: Tensor):
            return do, exchange.backward(None)

        (o,) = xp.custom_vjp(forward, backward, o0, s_ext)
        return o

    def forward_wide(o0: Tensor, q_eff: Tensor, s_ext: Tensor, m: Tensor):
        s_in = exchange.forward(s_ext, m)
        ct = xp.dtype(s_in)
        o = xp.cast(o0, ct) + heads_first(xp.matmul(heads_first(xp.cast(q_eff, ct)), s_in))
        # q_eff is a view of the widened output [R, T, H, V + K]: saving it would keep all of it
        # alive until the backward; a copy of its K columns is all the backward needs
        return (xp.cast(o, xp.dtype(o0)),), (q_eff.contiguous(), s_in)

    def backward_wide(saved, do: Tensor):
        q_eff, s_in = saved
        ct = xp.dtype(s_in)
        do_h = heads_first(xp.cast(do, ct))  # [R, H, T, V]
        ds_in = xp.matmul(xp.swapaxes(heads_first(xp.cast(q_eff, ct)), -1, -2), do_h)
        ds_out = exchange.backward(ds_in)
        dq = heads_first(xp.matmul(do_h, xp.swapaxes(s_in, -1, -2)))
        return do, xp.cast(dq, xp.dtype(q_eff)), ds_out, xp.matmul(ds_out, xp.swapaxes(s_in, -1, -2))

    (o,) = xp.custom_vjp(forward_wide, backward_wide, o0, q_eff, s_ext, m)
    return o


def shard_call(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    exchange: StateExchange,
    *,
    widened: bool,
    doc_starts: Any = None,
) -> Tensor:
    """A state mode's shard in one fla call (module docstring): rows q, k ``[R, T, Hk, K]``, v ``[R,
    T, H, V]``, g, beta ``[R, T, H]``; ``doc_starts`` None, bool ``[R, T]`` / ``[T]`` (rows of
    B = 1) or their :class:`~.varlen.Documents` (which keep the packed row's bounds for the
    forward's later layers) -> o ``[R, T, H, V]`` in q's dtype."""
    xp = ops_for(q)
    rows, seq_len, h, dv = v.shape
    dk = q.shape[-1]
    ct = xp.compute_dtype(q)
    if widened:
        values = xp.cat([v, xp.zeros((rows, seq_len, h, dk), like=v)], -1)
        eye = xp.eye(dk, like=xp.cast(g, ct)).reshape(1, 1, dk, dk)
        entry = xp.cat([xp.zeros((1, h, dk, dv), like=eye), eye + xp.zeros((1, h, dk, dk), like=eye)], -1)
    else:
        values, entry = v, None
    width = values.shape[-1]
    if doc_starts is None:
        initial = None if entry is None else entry + xp.zeros((rows, h, dk, width), like=entry)
        o_wide, final = _call(
            "widened" if widened else "chunk",
            q,
            k,
            values,
            g,
            beta,
            dispatched=False,
            initial_state=initial,
            final_state=True,
        )
    else:
        docs = Documents.of(doc_starts, seq_len=seq_len, rows=rows)
        cu, entered, last = docs.kept(("fla pieces", widened), lambda: _pieces(docs.starts, widened))
        zero = xp.zeros((1, h, dk, width), like=xp.cast(g, ct))
        initial = xp.cat([entry if e else zero for e in entered], 0) if widened else None

        def packed(x: Tensor) -> Tensor:
            return x.reshape(1, rows * seq_len, *x.shape[2:])

        o_wide, finals = _call(
            "widened" if widened else "chunk",
            *(packed(x) for x in (q, k, values, g, beta)),
            dispatched=False,
            cu_seqlens=cu,
            docs=docs,
            initial_state=initial,
            final_state=True,
        )
        o_wide = o_wide.reshape(rows, seq_len, h, width)
        final = xp.take(finals, last, 0)
    if not widened:
        return _exchange_step(exchange, o_wide, final, None, None)
    o0, q_eff = xp.split(o_wide, [dv, dk], -1)
    s_ext, m = xp.split(final, [dv, dk], -1)
    return _exchange_step(exchange, o0, s_ext, q_eff, m)
