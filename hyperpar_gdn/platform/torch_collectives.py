"""Differentiable collectives for PyTorch process groups (gloo, NCCL, HCCL).

Every collective takes a ``group`` (``None`` means the default group) and is called by every
member of that group in the same order. Ranks named in arguments (``dst``, ``src``) and the order of
splits and gathered slices are GROUP ranks, not global ranks.

The differentiable ones (:meth:`TorchCollectives.all_to_all`, :meth:`~TorchCollectives.all_gather`,
:meth:`~TorchCollectives.shift_right`) are ``torch.autograd.Function``s whose backward is the
reverse collective, so every member must also run the backward (it communicates).

Only primitives that work on gloo are used (see docs/backends.md): ``all_to_all_single`` with
contiguous input and uneven splits, ``all_gather_single`` (the new name of
``all_gather_into_tensor``, which torch 2.13 deprecates), ``batch_isend_irecv``. The gradient of
``all_gather`` is a reduce-scatter written as an even ``all_to_all_single`` followed by a sum over
senders, in group rank order: deterministic, and the same code on every backend (gloo in torch
2.13 has ``reduce_scatter_tensor`` too, but the design lists all_to_all_single as the primitive
measured to work).

Byte accounting (``bytes_sent``): the payload of this rank's data that lands on OTHER ranks, as if
every transfer went directly from sender to receiver, counted in forward and backward:

- ``all_to_all``: the rows sent to other ranks (the rows kept for itself are not counted); its
  backward counts the gradient rows sent back the same way.
- ``all_gather``: ``x.nbytes * (world - 1)``; its backward (reduce-scatter) counts
  ``x.nbytes * (world - 1)`` too: the gradient slices that belong to other ranks.
- ``shift_right``: ``x.nbytes`` on every rank but the last; its backward counts ``grad.nbytes`` on
  every rank but the first.
- ``all_gather_int``: 8 bytes (one int64) per other rank.
- ``exchange``: the nbytes of its sends (``send``: ``x.nbytes``); ``recv``: nothing; ``barrier``:
  nothing.
- ``all_reduce_sum``: ``x.nbytes * (world - 1)``.

The physical traffic of the backend's algorithm (rings, trees) differs; this is the logical volume
the traffic estimates of docs/modes.md use.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hyperpar_gdn.platform.base import (
    CollectiveError,
    Collectives,
    Group,
    check_all_to_all_splits,
    check_peers,
)

# torch 2.13 deprecates all_gather_into_tensor in favour of all_gather_single; older builds (the
# torch that a torch-npu release pins) may have only the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# torch before 2.6 (which torch-npu releases may pin) names point-to-point peers by global rank only
_GROUP_PEERS = "group_peer" in inspect.signature(dist.P2POp.__init__).parameters


def _p2p_op(op: Any, tensor: torch.Tensor, peer: int, group: Group | None) -> dist.P2POp:
    """A ``P2POp`` with the peer given as a GROUP rank (as the global rank on older torch)."""
    if _GROUP_PEERS:
        return dist.P2POp(op, tensor, group=group, group_peer=peer)
    return dist.P2POp(
        op, tensor, peer=dist.get_global_rank(group, peer) if group is not None else peer, group=group
    )


def _rank_and_size(group: Group | None, what: str) -> tuple[int, int]:
    if not dist.is_initialized():
        raise RuntimeError(f"{what} needs an initialized default process group (init_distributed())")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(
            f"{what}: global rank {dist.get_rank()} is not a member of the group "
            f"{dist.get_process_group_ranks(group)}"
        )
    return rank, dist.get_world_size(group)


@contextmanager
def _named(what: str, group: Group | None) -> Iterator[None]:
    """Re-raise a backend failure as a CollectiveError that names the collective and the group."""
    try:
        yield
    except (ValueError, CollectiveError):
        raise
    except Exception as err:
        ranks = (
            dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        )
        raise CollectiveError(
            f"collective {what} over global ranks {ranks} failed on rank {dist.get_rank()} "
            f"(a peer died, raised, or missed it within the process-group timeout): {type(err).__name__}: {err}"
        ) from err


def _row_bytes(x: torch.Tensor) -> int:
    return math.prod(x.shape[1:]) * x.element_size()


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        send_splits: list[int],
        recv_splits: list[int],
        group: Group | None,
        owner: TorchCollectives,
    ) -> torch.Tensor:
        ctx.send_splits, ctx.recv_splits, ctx.group, ctx.owner = send_splits, recv_splits, group, owner
        return owner._all_to_all(x, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        dx = ctx.owner._all_to_all(grad, ctx.recv_splits, ctx.send_splits, ctx.group)
        return dx, None, None, None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group | None, owner: TorchCollectives) -> torch.Tensor:
        ctx.group, ctx.owner = group, owner
        return owner._all_gather(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return ctx.owner._reduce_scatter(grad, ctx.group), None, None


class _ShiftRight(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group | None, owner: TorchCollectives) -> torch.Tensor:
        ctx.group, ctx.owner = group, owner
        return owner._shift(x, group, step=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return ctx.owner._shift(grad, ctx.group, step=-1), None, None


class TorchCollectives(Collectives):
    """Differentiable collectives over ``torch.distributed`` groups; see the module docstring for
    the ``bytes_sent`` convention."""

    def __init__(self) -> None:
        self.bytes_sent = 0
        # gloo applies the process-group timeout to collectives but not to point-to-point waits;
        # the platform sets this so that a missing peer fails every wait in time
        self.timeout: timedelta | None = None
        # where the collectives create their own tensors (all_gather_int); NCCL and HCCL need the
        # process's accelerator, which the platform sets when it joins the group
        self.device = torch.device("cpu")

    # --- differentiable ---------------------------------------------------------------------------
    def all_to_all(
        self, x: torch.Tensor, send_splits: Sequence[int], recv_splits: Sequence[int], group: Group | None
    ) -> torch.Tensor:
        """:meth:`Collectives.all_to_all` (the contract is written there)."""
        _, world = _rank_and_size(group, "all_to_all")
        send, recv = check_all_to_all_splits(tuple(x.shape), send_splits, recv_splits, world)
        return _AllToAll.apply(x, send, recv, group, self)

    def all_gather(self, x: torch.Tensor, group: Group | None) -> torch.Tensor:
        """``[world, *x.shape]``: every group rank's ``x`` (same shape on every rank), stacked in
        group rank order. The gradient is reduce-scattered: rank r gets the sum over ranks of
        their gradient for slice r."""
        _rank_and_size(group, "all_gather")
        return _AllGather.apply(x, group, self)

    def all_gather_int(self, value: int, group: Group | None) -> list[int]:
        """Every group rank's ``value``, in group rank order (one int64 each; not differentiable)."""
        _, world = _rank_and_size(group, "all_gather_int")
        mine = torch.tensor([int(value)], dtype=torch.int64, device=self.device)
        out = torch.empty(world, dtype=torch.int64, device=self.device)
        with _named("all_gather_int", group):
            self._collective(_all_gather_single, out, mine, group=group)
        self.bytes_sent += 8 * (world - 1)
        return [int(v) for v in out.tolist()]

    def shift_right(self, x: torch.Tensor, group: Group | None) -> torch.Tensor:
        """Send ``x`` (same shape on every rank) to group rank + 1 and return what group rank - 1
        sent; zeros on group rank 0; the last rank's ``x`` goes nowhere (its gradient is zero).
        The gradient of the result travels from rank r to rank r - 1."""
        _rank_and_size(group, "shift_right")
        return _ShiftRight.apply(x, group, self)

    # --- raw, not differentiable ------------------------------------------------------------------
    def exchange(
        self,
        sends: Sequence[tuple[torch.Tensor, int]],
        recvs: Sequence[tuple[torch.Tensor, int]],
        group: Group | None,
    ) -> list[torch.Tensor]:
        """:meth:`Collectives.exchange`: one ``batch_isend_irecv`` of every send and receive (NCCL
        groups them, so their order does not matter and the round costs one latency)."""
        rank, world = _rank_and_size(group, "exchange")
        check_peers(sends, recvs, rank, world)
        what = f"exchange (send to {[d for _, d in sends]}, receive from {[s for _, s in recvs]})"
        return self._batch(sends, recvs, group, what)

    def _batch(
        self,
        sends: Sequence[tuple[torch.Tensor, int]],
        recvs: Sequence[tuple[torch.Tensor, int]],
        group: Group | None,
        what: str,
    ) -> list[torch.Tensor]:
        """One ``batch_isend_irecv`` of checked sends and receives (the exchange and the shift)."""
        ops, out = [], []
        for x, dst in sends:
            x = x.detach().contiguous()
            ops.append(_p2p_op(dist.isend, x, dst, group))
            self.bytes_sent += x.numel() * x.element_size()
        for like, src in recvs:
            out.append(torch.empty(like.shape, dtype=like.dtype, device=like.device))
            ops.append(_p2p_op(dist.irecv, out[-1], src, group))
        if ops:
            with _named(what, group):
                for work in dist.batch_isend_irecv(ops):
                    self._wait(work)
        return out

    def barrier(self, group: Group | None) -> None:
        _rank_and_size(group, "barrier")
        with _named("barrier", group):
            self._collective(dist.barrier, group=group)

    def all_reduce_sum(self, x: torch.Tensor, group: Group | None = None) -> torch.Tensor:
        """Sum ``x`` over the group in place and return it (not differentiable)."""
        _, world = _rank_and_size(group, "all_reduce_sum")
        if not x.is_contiguous():
            raise ValueError(
                f"all_reduce_sum works in place and needs a contiguous x (shape {tuple(x.shape)})"
            )
        with torch.no_grad(), _named("all_reduce_sum", group):
            self._collective(dist.all_reduce, x, op=dist.ReduceOp.SUM, group=group)
        self.bytes_sent += x.numel() * x.element_size() * (world - 1)
        return x

    # --- implementations (also used by the backwards) ---------------------------------------------
    def _collective(self, collective: Any, /, *args: Any, **kwargs: Any) -> None:
        """Run ``collective(*args, **kwargs)``. On the CPU (gloo) it is started asynchronously and waited with
        the timeout: gloo's blocking all-gather and all-to-all were seen waiting past the
        process-group timeout when a peer was stopped (SIGSTOP) mid-run. NCCL and HCCL keep the
        blocking call (their waits order streams; their watchdogs enforce the timeout)."""
        if self.device.type != "cpu" or self.timeout is None:
            collective(*args, **kwargs)
        else:
            self._wait(collective(*args, async_op=True, **kwargs))

    def _wait(self, work: Any) -> None:
        """Wait for ``work``. On gloo with the timeout (gloo does not bound point-to-point waits by
        itself). On NCCL and HCCL a plain ``wait()``, which only orders the current stream after the
        work: a wait with a timeout would block the host until the kernel ends (draining the queue
        every message); the process group's timeout and the backend's watchdog bound a hang."""
        if self.device.type != "cpu" or self.timeout is None:
            work.wait()
        else:
            work.wait(timeout=self.timeout)

    def _all_to_all(
        self, x: torch.Tensor, send: list[int], recv: list[int], group: Group | None
    ) -> torch.Tensor:
        rank, _ = _rank_and_size(group, "all_to_all")
        x = x.contiguous()
        out = x.new_empty((sum(recv), *x.shape[1:]))
        with _named("all_to_all", group):
            self._collective(
                dist.all_to_all_single, out, x, output_split_sizes=recv, input_split_sizes=send, group=group
            )
        self.bytes_sent += (sum(send) - send[rank]) * _row_bytes(x)
        return out

    def _all_gather(self, x: torch.Tensor, group: Group | None) -> torch.Tensor:
        _, world = _rank_and_size(group, "all_gather")
        flat = x.contiguous().reshape(-1)
        out = flat.new_empty(world * flat.numel())
        if flat.numel():
            with _named("all_gather", group):
                self._collective(_all_gather_single, out, flat, group=group)
        self.bytes_sent += flat.numel() * flat.element_size() * (world - 1)
        return out.view(world, *x.shape)

    def _reduce_scatter(self, grad: torch.Tensor, group: Group | None) -> torch.Tensor:
        _, world = _rank_and_size(group, "all_gather backward")
        shape = grad.shape[1:]
        flat = grad.contiguous().reshape(-1)
        parts = flat.new_empty(flat.numel())
        if flat.numel():
            with _named("all_gather backward (reduce-scatter)", group):
                self._collective(dist.all_to_all_single, parts, flat, group=group)  # row j lands on rank j
        self.bytes_sent += flat.numel() // world * flat.element_size() * (world - 1)
        return parts.view(world, *shape).sum(0)

    def _shift(self, x: torch.Tensor, group: Group | None, *, step: int) -> torch.Tensor:
        rank, world = _rank_and_size(group, "shift_right")
        x = x.contiguous()
        sends = [(x, rank + step)] if 0 <= rank + step < world else []
        recvs = [(x, rank - step)] if 0 <= rank - step < world else []
        if not x.numel():  # same shape on every rank: all skip an empty exchange together
            return torch.zeros_like(x)
        got = self._batch(sends, recvs, group, "shift_right" if step > 0 else "shift_right backward")
        return got[0] if got else torch.zeros_like(x)
