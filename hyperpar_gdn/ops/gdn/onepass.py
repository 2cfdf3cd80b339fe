"""One pass for a shard's outputs and its summary (docs/maths.md), for context parallelism.

A shard of a sequence does not know the state S_in entering it until other ranks have run. Its
outputs are affine in S_in, o = o0 + Q_eff S_in, and so is the state leaving it,
S_out = M S_in + S_ext. One chunk recurrence on the widened state X = [S | M] ``[B, H, K, V+K]``
from [0 | I], with values [u | 0], gives all of them at once, before any communication: the V
columns of each chunk's entering state and corrected values are those of a zero entering state,
the K columns map S_in to their share, and the final X is the summary [S_ext | M]. Q_eff (the
outputs' map) is taken from them in two batched products.

:func:`shard_outputs` runs that pass, hands the summary to a :class:`StateExchange` (the
communication, :mod:`hyperpar_gdn.distributed.cp.state_passing`), which returns S_in, and then
runs the plain chunk loop entered by S_in for the true chunk states and outputs (the same as
S_i = S0_i + M_i S_in from the widened pass, computed in fewer steps). Backward:

- dS_in = sum over chunks of Q_eff^T do goes to the exchange first, which passes it on to the
  ranks before this one and returns dS_out, the gradient of the state leaving the shard (from the
  ranks after it). Only this affine step waits for peers.
- Everything else is the single-device backward of the shard entered by S_in: the reverse state
  loop of width V from the true states, with do and dS_out. The widened pass's columns are not
  differentiated: o and S_out as functions of the shard's inputs and S_in are exactly the plain
  recurrence entered by S_in, so its backward gives the same gradients as backpropagating through
  [S | M] and Q_eff, at half the width. Measured (forward+backward of the rule on a T=4096, H=4,
  K=V=128 shard, one thread, in turns): 310 ms through the widened backward, 244 ms this way,
  184 ms for the plain shard with no entering state.

A shard that no other state enters (the first one) runs the plain width-V pass (``widened=False``):
its final state is S_ext, it has no Q_eff and its exchange returns a zero S_in.

Packed documents need nothing more: past a cut the prepared chunks (``first``/``last`` masks,
:mod:`hyperpar_gdn.ops.gdn.chunk`) zero the rows of Q_eff and the columns of M, exactly as they stop
the true entering state.

Legend: N chunks, B batch, H value heads, C chunk size, K key dim, V value dim, T tokens.
"""

from __future__ import annotations

from typing import Protocol

from hyperpar_gdn.ops.gdn.chunk import ChunkPrep
from hyperpar_gdn.ops.gdn.common import to_chunks
from hyperpar_gdn.ops.gdn.recurrence import forward_states, outputs_backward, outputs_forward
from hyperpar_gdn.platform import Tensor, TensorOps


class StateExchange(Protocol):
    """What a shard needs from its peers, in both directions (one object per call)."""

    def forward(self, s_ext: Tensor, m: Tensor | None) -> Tensor:
        """This shard's summary, S_ext ``[B, H, K, V]`` and M ``[B, H, K, K]`` (None for a shard
        that no state enters) -> the state S_in ``[B, H, K, V]`` entering it."""
        ...

    def backward(self, ds_in: Tensor | None) -> Tensor:
        """The gradient of S_in from this shard's outputs ``[B, H, K, V]`` (None when not
        widened) -> dS_out ``[B, H, K, V]``, the gradient of the state leaving the shard."""
        ...


def _widened_entry(xp: TensorOps, u: Tensor, dk: int) -> tuple[Tensor, Tensor]:
    """The values [u | 0] ``[N, B, H, C, V+K]`` and the one entry [0 | I] ``[1, B, H, K, V+K]`` of
    the widened recurrence."""
    n, b, h, c, dv = u.shape
    u_wide = xp.cat([u, xp.zeros((n, b, h, c, dk), like=u)], -1)
    eye = xp.eye(dk, like=u).reshape(1, 1, 1, dk, dk) + xp.zeros((1, b, h, dk, dk), like=u)
    return u_wide, xp.cat([xp.zeros((1, b, h, dk, dv), like=u), eye], -1)


def _forward(xp: TensorOps, exchange: StateExchange, seq_len: int, qg, p, u, w, kd, gl, *, widened: bool):
    _, b, h, _, dv = u.shape
    dk = w.shape[-1]
    q_eff, entering = None, xp.zeros((1, b, h, dk, dv), like=u)
    if widened:
        # The widened state's M columns are products of decays, which sink into subnormal floats.
        values, entry = _widened_entry(xp, u, dk)
        states, vn, exits = forward_states(xp, values, w, kd, gl, entry, flush=True)
        q_eff = xp.matmul(qg, states[..., dv:]) + xp.matmul(p, vn[..., dv:])  # [N, B, H, C, K]
        del states, vn  # the widened pass is done with: only Q_eff and the summary are kept
        s_in = exchange.forward(exits[0][..., :dv], exits[0][..., dv:])
        entering = s_in.reshape((1,) + tuple(s_in.shape))
    # The plain output pass, entered by S_in: the true chunk states and corrected values (measured
    # a little faster than S0_i + M_i S_in and vn0_i + vnM_i S_in as batched products).
    (o, exits), saved = outputs_forward(xp, qg, p, u, w, kd, gl, entering, seq_len=seq_len)
    if not widened:
        exchange.forward(exits[0], None)
    return (o,), (*saved, q_eff)


def _backward(xp: TensorOps, exchange: StateExchange, saved, do: Tensor):
    *plain, q_eff = saved
    ds_in = None
    if q_eff is not None:
        ds_in = xp.sum(xp.matmul(xp.swapaxes(q_eff, -1, -2), to_chunks(xp, do, q_eff.shape[3])), 0)
    ds_out = exchange.backward(ds_in)
    grads = outputs_backward(xp, tuple(plain), do, ds_out.reshape((1,) + tuple(ds_out.shape)))
    return grads[:6]  # those of qg, p, u, w, kd, gl (the entering state's is the exchange's)


def shard_outputs(prep: ChunkPrep, exchange: StateExchange, *, widened: bool = True) -> Tensor:
    """The outputs ``[B, T, H, V]`` (compute dtype) of a prepared shard entered by the state that
    ``exchange`` returns for its summary; see the module docstring. ``widened=False``: a shard
    that no state enters; its exchange gets M = None and what it returns is not used.
    Differentiable with respect to the prepared tensors; S_in's gradient goes to the exchange."""
    xp = prep.xp
    (o,) = xp.custom_vjp(
        lambda *a: _forward(xp, exchange, prep.seq_len, *a, widened=widened),
        lambda saved, do: _backward(xp, exchange, saved, do),
        *prep.pass_inputs,
    )
    return o
