"""Differentiable collectives for MindSpore 2.10 (MCCL on CPU, HCCL on Ascend), in PyNative mode.

Groups are :class:`MindSporeGroup` handles (a MindSpore group name plus the global ranks in group
rank order) made by :meth:`MindSporePlatform.new_group`; ``None`` means the world. Ranks named in
arguments (``dst``, ``src``) and the order of splits and gathered slices are GROUP ranks, as in
:mod:`.torch_collectives`. Every member of a group calls each collective in the same order.

No built-in MindSpore collective carries gradients across ranks, so the differentiable ones
(:meth:`~MindSporeCollectives.all_to_all`, :meth:`~MindSporeCollectives.all_gather`,
:meth:`~MindSporeCollectives.shift_right`) are ``Cell``\\ s with a ``bprop`` whose backward is the
reverse collective; every member must run the backward too (it communicates).

What each collective is built from (measured on CPU, see docs/backends.md):

- ``all_to_all``: ``AlltoAllV`` (``all_to_all_single``) on Ascend; on CPU, which has no AlltoAll,
  one ``isend`` per non-empty outgoing part and one ``irecv`` per non-empty incoming part, all
  posted before waiting (MCCL buffers sends, so no pairing order is needed).
- ``all_gather``: the list ``all_gather`` (the ``AllGather`` primitive works on CPU only for the
  world group). Its backward is a reduce-scatter: ``reduce_scatter_tensor`` on Ascend; on CPU,
  which has none, an even ``all_to_all`` of the gradient followed by a sum over senders in group
  rank order (deterministic, as the torch platform's).
- ``shift_right`` and ``exchange`` (point-to-point rounds): one ``batch_isend_irecv`` on Ascend;
  on CPU every ``isend``, then every ``irecv``, all posted before waiting.
- ``all_gather_int``: the list ``all_gather`` of one int64 per rank (not differentiable).
- ``all_reduce_sum``: the native ``all_reduce``, but for float64 on CPU (MCCL's AllReduce fails
  on float64: an all-gather and a sum in group rank order there); it returns a NEW tensor and
  leaves ``x`` unchanged (see the method).

Byte accounting (``bytes_sent``) follows :mod:`.torch_collectives` exactly: the logical payload of
this rank's data that lands on OTHER ranks, in forward and backward.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import mindspore as ms
import mindspore.ops.communication as comm_ops
import numpy as np
from mindspore import nn, ops

from hyperpar_gdn.platform.base import (
    CollectiveError,
    Collectives,
    Group,
    check_all_to_all_splits,
    check_peers,
)


@dataclass(frozen=True)
class MindSporeGroup:
    """A MindSpore communication group: its ``name`` and its global ``ranks`` in group rank order.

    ``local=True`` marks the 1-rank world of a process started without a launcher, where no
    communication library is initialised and every collective is a local copy.
    """

    name: str
    ranks: tuple[int, ...]
    local: bool = False

    @property
    def size(self) -> int:
        return len(self.ranks)

    def group_rank(self, global_rank: int) -> int:
        """This group's rank of ``global_rank``; -1 if it is not a member."""
        return self.ranks.index(global_rank) if global_rank in self.ranks else -1


@contextmanager
def _named(what: str, group: MindSporeGroup, rank: int) -> Iterator[None]:
    """Re-raise a MindSpore communication failure as a :class:`CollectiveError`."""
    try:
        yield
    except (ValueError, CollectiveError):
        raise
    except Exception as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise CollectiveError(
            f"collective {what} over global ranks {list(group.ranks)} failed on rank {rank} "
            f"(a peer died, raised, or missed it within the communication timeout): "
            f"{type(err).__name__}: {first_line}"
        ) from err


def _nbytes(x: ms.Tensor) -> int:
    return math.prod(x.shape) * x.itemsize


def _received(result: object, buf: ms.Tensor) -> tuple[ms.Tensor, object]:
    """(the received tensor, the handle) from what ``irecv`` returned: a handle when the
    communication ops write in place (the tensor is then ``buf``), else ``(tensor, handle)``."""
    if isinstance(result, tuple):
        return result[0], result[1]
    return buf, result


def _row_bytes(x: ms.Tensor) -> int:
    return math.prod(x.shape[1:]) * x.itemsize


class _AllToAllCell(nn.Cell):
    """One differentiable all-to-all; the backward sends the gradient rows back the same way."""

    def __init__(self, owner: MindSporeCollectives, send: list[int], recv: list[int], group: MindSporeGroup):
        super().__init__(auto_prefix=False)
        self._owner, self._send, self._recv, self._group = owner, send, recv, group

    def construct(self, x: ms.Tensor) -> ms.Tensor:
        return self._owner._all_to_all(x, self._send, self._recv, self._group)

    def bprop(self, x: ms.Tensor, out: ms.Tensor, dout: ms.Tensor) -> tuple[ms.Tensor]:
        return (self._owner._all_to_all(dout, self._recv, self._send, self._group, "all_to_all backward"),)


class _AllGatherCell(nn.Cell):
    """One differentiable all-gather; the backward reduce-scatters the gradient to its owners."""

    def __init__(self, owner: MindSporeCollectives, group: MindSporeGroup):
        super().__init__(auto_prefix=False)
        self._owner, self._group = owner, group

    def construct(self, x: ms.Tensor) -> ms.Tensor:
        return self._owner._all_gather(x, self._group)

    def bprop(self, x: ms.Tensor, out: ms.Tensor, dout: ms.Tensor) -> tuple[ms.Tensor]:
        return (self._owner._reduce_scatter(dout, self._group),)


class _ShiftRightCell(nn.Cell):
    """One differentiable shift to the next rank; the backward shifts the gradient back."""

    def __init__(self, owner: MindSporeCollectives, group: MindSporeGroup):
        super().__init__(auto_prefix=False)
        self._owner, self._group = owner, group

    def construct(self, x: ms.Tensor) -> ms.Tensor:
        return self._owner._shift(x, self._group, step=1)

    def bprop(self, x: ms.Tensor, out: ms.Tensor, dout: ms.Tensor) -> tuple[ms.Tensor]:
        return (self._owner._shift(dout, self._group, step=-1),)


class MindSporeCollectives(Collectives):
    """Differentiable collectives over MindSpore communication groups.

    The platform calls :meth:`bind` once its world is set up; before that every collective raises
    ``RuntimeError``. See the module docstring for what each collective is built from and for the
    ``bytes_sent`` convention.

    Args:
        native_all_to_all: use the backend's AlltoAllV and ReduceScatter (Ascend/HCCL) instead of
            building them from isend/irecv (CPU/MCCL has neither).
    """

    def __init__(self, *, native_all_to_all: bool = False) -> None:
        self.bytes_sent = 0
        self.native_all_to_all = native_all_to_all
        self._world: MindSporeGroup | None = None
        self._rank = 0

    def bind(self, world: MindSporeGroup, rank: int) -> None:
        """Use ``world`` for ``group=None``; ``rank`` is this process's global rank."""
        self._world, self._rank = world, rank

    def unbind(self) -> None:
        self._world = None

    # --- differentiable ---------------------------------------------------------------------------
    def all_to_all(
        self, x: ms.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int], group: Group | None
    ) -> ms.Tensor:
        """:meth:`Collectives.all_to_all` (the contract is written there)."""
        g, _ = self._resolve(group, "all_to_all")
        world = g.size
        send, recv = check_all_to_all_splits(tuple(x.shape), send_splits, recv_splits, world)
        return _AllToAllCell(self, send, recv, g)(x)

    def all_gather(self, x: ms.Tensor, group: Group | None) -> ms.Tensor:
        """``[world, *x.shape]``: every group rank's ``x`` (same shape on every rank), stacked in
        group rank order. The gradient is reduce-scattered: rank r gets the sum over ranks of
        their gradient for slice r."""
        g, _ = self._resolve(group, "all_gather")
        return _AllGatherCell(self, g)(x)

    def all_gather_int(self, value: int, group: Group | None) -> list[int]:
        """Every group rank's ``value``, in group rank order (one int64 each; not differentiable)."""
        g, _ = self._resolve(group, "all_gather_int")
        gathered = self._all_gather(ms.Tensor(np.array([int(value)], dtype=np.int64)), g)
        return [int(v) for v in gathered.asnumpy().ravel()]

    def shift_right(self, x: ms.Tensor, group: Group | None) -> ms.Tensor:
        """Send ``x`` (same shape on every rank) to group rank + 1 and return what group rank - 1
        sent; zeros on group rank 0; the last rank's ``x`` goes nowhere (its gradient is zero).
        The gradient of the result travels from rank r to rank r - 1."""
        g, _ = self._resolve(group, "shift_right")
        return _ShiftRightCell(self, g)(x)

    # --- raw, not differentiable ------------------------------------------------------------------
    def exchange(
        self,
        sends: Sequence[tuple[ms.Tensor, int]],
        recvs: Sequence[tuple[ms.Tensor, int]],
        group: Group | None,
    ) -> list[ms.Tensor]:
        """:meth:`Collectives.exchange`. On Ascend one ``batch_isend_irecv`` (HCCL's send and
        receive are strongly synchronized: posted one by one they would serialize); on CPU every
        ``isend`` then every ``irecv``, waited together (MCCL buffers sends). Received tensors are
        the values the receives return (the buffers only where the communication ops write in
        place)."""
        g, rank = self._resolve(group, "exchange")
        check_peers(sends, recvs, rank, g.size)
        for x, _ in sends:
            self.bytes_sent += _nbytes(x)
        what = f"exchange (send to {[d for _, d in sends]}, receive from {[s for _, s in recvs]})"
        with _named(what, g, self._rank):
            return self._exchange(g, [(x.contiguous(), d) for x, d in sends], recvs)

    def barrier(self, group: Group | None) -> None:
        g, _ = self._resolve(group, "barrier")
        if g.size > 1:
            with _named("barrier", g, self._rank):
                comm_ops.barrier(group=g.name)

    def all_reduce_sum(self, x: ms.Tensor, group: Group | None = None) -> ms.Tensor:
        """The sum of ``x`` over the group (not differentiable).

        Unlike the torch platform this is NOT in place: MindSpore tensors handed out by autograd
        are not meant to be written to, so ``x`` is left unchanged. Use the return value (as
        ``hyperpar_gdn.distributed.verify`` does)."""
        g, _ = self._resolve(group, "all_reduce_sum")
        if g.size == 1:
            return x.copy()
        if x.dtype == ms.float64 and not self.native_all_to_all:  # MCCL's AllReduce fails on float64
            gathered = self._all_gather(x, g)  # counts x.nbytes * (world - 1), as an all-reduce does
            total = gathered[0]
            for j in range(1, g.size):
                total = total + gathered[j]
            return total
        self.bytes_sent += _nbytes(x) * (g.size - 1)
        buf = x.copy()
        with _named("all_reduce_sum", g, self._rank):
            result = comm_ops.all_reduce(buf, op="sum", group=g.name)
        return result[0] if isinstance(result, tuple) else buf  # out of place, or written into buf

    # --- implementations (also used by the backwards) ---------------------------------------------
    def _resolve(self, group: Group | None, what: str) -> tuple[MindSporeGroup, int]:
        """(the group, this process's rank in it); errors name the group and the rank."""
        if self._world is None:
            raise RuntimeError(f"{what} needs an initialized platform (MindSporePlatform.init_distributed())")
        g = self._world if group is None else group
        if not isinstance(g, MindSporeGroup):
            raise TypeError(
                f"{what}: group must be a MindSporeGroup from MindSporePlatform.new_group() or None, "
                f"got {type(g).__name__}"
            )
        rank = g.group_rank(self._rank)
        if rank < 0:
            raise ValueError(f"{what}: global rank {self._rank} is not a member of the group {list(g.ranks)}")
        return g, rank

    def _all_to_all(
        self, x: ms.Tensor, send: list[int], recv: list[int], g: MindSporeGroup, what: str = "all_to_all"
    ) -> ms.Tensor:
        with _named(what, g, self._rank):
            return self._all_to_all_unnamed(x, send, recv, g)

    def _all_to_all_unnamed(
        self, x: ms.Tensor, send: list[int], recv: list[int], g: MindSporeGroup
    ) -> ms.Tensor:
        rank = g.group_rank(self._rank)
        rows = x.shape[1:]
        self.bytes_sent += (sum(send) - send[rank]) * _row_bytes(x)
        if g.size == 1:
            return x.copy()
        if self.native_all_to_all:  # Ascend: AlltoAllV
            out = ops.zeros((sum(recv), *rows), x.dtype)
            comm_ops.all_to_all_single(out, x.contiguous(), recv, send, group=g.name)
            return out
        offsets = [0]
        for s in send:
            offsets.append(offsets[-1] + s)
        handles = []
        for j in range(g.size):
            if j != rank and send[j]:
                part = x[offsets[j] : offsets[j + 1]].contiguous()
                handles.append((comm_ops.isend(part, dst=g.ranks[j], group=g.name), part))
        parts: list[ms.Tensor | None] = [None] * g.size
        for j in range(g.size):
            if j != rank and recv[j]:
                parts[j] = ops.zeros((recv[j], *rows), x.dtype)
                parts[j], handle = _received(comm_ops.irecv(parts[j], src=g.ranks[j], group=g.name), parts[j])
                handles.append((handle, parts[j]))
        if recv[rank]:
            parts[rank] = x[offsets[rank] : offsets[rank + 1]]
        for handle, _ in handles:
            handle.wait()
        present = [p for p in parts if p is not None]
        if not present:
            return ops.zeros((0, *rows), x.dtype)
        return present[0].copy() if len(present) == 1 else ops.cat(present, 0)

    def _all_gather(self, x: ms.Tensor, g: MindSporeGroup) -> ms.Tensor:
        shape = tuple(x.shape)
        self.bytes_sent += _nbytes(x) * (g.size - 1)
        if g.size == 1:
            return x.reshape(1, *shape).copy()
        if math.prod(shape) == 0:  # same shape on every rank: all skip an empty exchange together
            return ops.zeros((g.size, *shape), x.dtype)
        flat = x.reshape(-1).contiguous()
        outs = [ops.zeros(flat.shape, x.dtype) for _ in range(g.size)]
        with _named("all_gather", g, self._rank):
            comm_ops.all_gather(outs, flat, group=g.name)
        return ops.cat(outs, 0).reshape(g.size, *shape)  # cat, not stack: CPU stack has no bf16

    def _reduce_scatter(self, grad: ms.Tensor, g: MindSporeGroup) -> ms.Tensor:
        shape = tuple(grad.shape[1:])
        if g.size == 1:
            return grad[0].copy()
        if self.native_all_to_all:  # Ascend: ReduceScatter (sums in the backend's order)
            self.bytes_sent += _nbytes(grad) // g.size * (g.size - 1)
            out = ops.zeros((math.prod(shape),), grad.dtype)
            with _named("all_gather backward (reduce-scatter)", g, self._rank):
                comm_ops.reduce_scatter_tensor(out, grad.reshape(-1).contiguous(), group=g.name)
            return out.reshape(shape)
        # row j of every rank lands on rank j; _all_to_all counts the rows that leave this rank
        parts = self._all_to_all(grad, [1] * g.size, [1] * g.size, g, "all_gather backward (reduce-scatter)")
        total = parts[0]
        for j in range(1, g.size):
            total = total + parts[j]
        return total

    def _exchange(
        self, g: MindSporeGroup, sends: list[tuple[ms.Tensor, int]], recvs: Sequence[tuple[ms.Tensor, int]]
    ) -> list[ms.Tensor]:
        bufs = [ops.zeros(tuple(like.shape), like.dtype) for like, _ in recvs]
        if not sends and not recvs:
            return []
        if self.native_all_to_all:  # Ascend: one batch of HCCL point-to-point
            batch = [comm_ops.P2POp("isend", x, g.ranks[d], group=g.name) for x, d in sends]
            batch += [
                comm_ops.P2POp("irecv", b, g.ranks[s], group=g.name)
                for b, (_, s) in zip(bufs, recvs, strict=True)
            ]
            for handle in comm_ops.batch_isend_irecv(batch):
                handle.wait()
            return bufs  # batch_isend_irecv has no out-of-place form: it fills the buffers
        handles = [comm_ops.isend(x, dst=g.ranks[d], group=g.name) for x, d in sends]
        out = []
        for buf, (_, src) in zip(bufs, recvs, strict=True):
            got, handle = _received(comm_ops.irecv(buf, src=g.ranks[src], group=g.name), buf)
            out.append(got)
            handles.append(handle)
        for handle in handles:
            handle.wait()
        return out

    def _shift(self, x: ms.Tensor, g: MindSporeGroup, *, step: int) -> ms.Tensor:
        rank = g.group_rank(self._rank)
        send_to, recv_from = rank + step, rank - step
        if 0 <= send_to < g.size:
            self.bytes_sent += _nbytes(x)
        if math.prod(x.shape) == 0 or g.size == 1:  # same shape on every rank: all skip together
            return ops.zeros(tuple(x.shape), x.dtype)
        sends = [(x.contiguous(), send_to)] if 0 <= send_to < g.size else []
        recvs = [(x, recv_from)] if 0 <= recv_from < g.size else []
        with _named("shift_right" if step > 0 else "shift_right backward", g, self._rank):
            got = self._exchange(g, sends, recvs)
        return got[0] if got else ops.zeros(tuple(x.shape), x.dtype)

    def __repr__(self) -> str:
        world = None if self._world is None else list(self._world.ranks)
        return f"MindSporeCollectives(world={world}, native_all_to_all={self.native_all_to_all})"
