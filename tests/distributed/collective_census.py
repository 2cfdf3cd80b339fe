"""What a rank's collectives ask of its process group: every call counted and timed while the real
collectives run, and the rounds on the critical path of a whole job.

:class:`Census` wraps the ``torch.distributed`` functions that
:mod:`hyperpar_gdn.platform.torch_collectives` calls (``isend``, ``irecv``, ``batch_isend_irecv``,
``all_to_all_single``, the all-gather, ``all_reduce``, ``barrier``): each call is passed on
unchanged and logged as an :class:`Event` (its group's global ranks, the peers a point-to-point
call sends to or receives from, the bytes it hands to other ranks, the size of the buffer it
fills), and the time the rank spends waiting for it (the blocking call, or ``Work.wait``) is added
up. Bytes follow the platform's convention (``bytes_sent``: an all-to-all's rows for other ranks,
an all-gather's input once per other rank, a send's tensor) but are read from the arguments the
process group gets, not from the platform's counter. Events carry the segment that was current
when they started (:meth:`Census.mark`; :meth:`Census.mark_layers` marks each decoder layer's
forward and backward), so a step's traffic splits by layer::

    census = Census()
    with census.installed():
        census.mark_layers(model.model.layers)
        loss = model(**inputs).logits.sum()
        loss.backward()
    census.bytes_by_segment()   # {"fwd0": ..., "bwd0": ..., ...}

:func:`critical_rounds` replays every rank's events in their order: a received message is one
round after its send, a collective of g ranks ends ``weight(g)`` rounds after its last member
arrived; the longest chain is the number of rounds in sequence. Forked ranks only (it patches the
module in the process that calls it)."""

from __future__ import annotations

import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hyperpar_gdn.platform import torch_collectives

__all__ = ["COLLECTIVES", "Census", "Event", "critical_rounds"]

COLLECTIVES = ("all_to_all", "all_gather", "all_reduce", "barrier")


@dataclass(frozen=True)
class Event:
    """One call of a rank into its process group.

    ``op``: ``send``, ``recv``, ``batch`` (``batch_isend_irecv``) or one of :data:`COLLECTIVES`;
    ``group``: the group's global ranks; ``sends``/``recvs``: global peers of point-to-point calls;
    ``nbytes``: bytes handed to other ranks; ``filled``: bytes of the largest buffer it fills;
    ``segment``: the mark current when it started."""

    op: str
    group: tuple[int, ...]
    sends: tuple[int, ...]
    recvs: tuple[int, ...]
    nbytes: int
    filled: int
    segment: str


class _TimedWork:
    """A ``Work`` whose waits add to the census' waiting time."""

    def __init__(self, work: Any, census: Census) -> None:
        self._work, self._census = work, census

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._census.waited(time.perf_counter() - start)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _ranks(group: Any) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size()))


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


class _CountingDist:
    """``torch.distributed`` as the platform sees it: the calls it makes counted, the rest as is."""

    def __init__(self, census: Census) -> None:
        self._census = census

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    def _timed(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            out = call(*args, **kwargs)
        finally:
            self._census.waited(time.perf_counter() - start)
        if isinstance(out, list):
            return [_TimedWork(w, self._census) for w in out]
        return None if out is None else _TimedWork(out, self._census)

    def isend(self, tensor: torch.Tensor, **kwargs: Any) -> Any:
        group = kwargs.get("group")
        peer = dist.get_global_rank(group, kwargs["group_dst"]) if group is not None else kwargs["group_dst"]
        self._census.log("send", group, sends=(peer,), nbytes=_nbytes(tensor))
        return self._timed(dist.isend, tensor, **kwargs)

    def irecv(self, tensor: torch.Tensor, **kwargs: Any) -> Any:
        group = kwargs.get("group")
        peer = dist.get_global_rank(group, kwargs["group_src"]) if group is not None else kwargs["group_src"]
        self._census.log("recv", group, recvs=(peer,), filled=_nbytes(tensor))
        return self._timed(dist.irecv, tensor, **kwargs)

    def P2POp(self, op: Callable[..., Any], tensor: torch.Tensor, **kwargs: Any) -> Any:  # noqa: N802
        real = {self.isend: dist.isend, self.irecv: dist.irecv}.get(op, op)
        return dist.P2POp(real, tensor, **kwargs)

    def batch_isend_irecv(self, ops: list[Any]) -> Any:
        sends = tuple(o.peer for o in ops if o.op is dist.isend)
        recvs = tuple(o.peer for o in ops if o.op is dist.irecv)
        self._census.log(
            "batch",
            ops[0].group,
            sends=sends,
            recvs=recvs,
            nbytes=sum(_nbytes(o.tensor) for o in ops if o.op is dist.isend),
            filled=max((_nbytes(o.tensor) for o in ops if o.op is dist.irecv), default=0),
        )
        return self._timed(dist.batch_isend_irecv, ops)

    def all_to_all_single(self, out: torch.Tensor, x: torch.Tensor, **kwargs: Any) -> Any:
        group = kwargs.get("group")
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        send = kwargs.get("input_split_sizes") or [x.shape[0] // world] * world
        row = _nbytes(x) // max(x.shape[0], 1)
        self._census.log("all_to_all", group, nbytes=(sum(send) - send[rank]) * row, filled=_nbytes(out))
        return self._timed(dist.all_to_all_single, out, x, **kwargs)

    def all_reduce(self, x: torch.Tensor, **kwargs: Any) -> Any:
        group = kwargs.get("group")
        world = dist.get_world_size(group)
        self._census.log("all_reduce", group, nbytes=_nbytes(x) * (world - 1), filled=_nbytes(x))
        return self._timed(dist.all_reduce, x, **kwargs)

    def barrier(self, **kwargs: Any) -> Any:
        self._census.log("barrier", kwargs.get("group"))
        return self._timed(dist.barrier, **kwargs)


class Census:
    """The events and waiting time of this rank's collectives; see the module docstring."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.wait_s: dict[str, float] = defaultdict(float)
        self.segment = "setup"
        self._gather: Callable[..., Any] | None = None

    def log(
        self,
        op: str,
        group: Any,
        *,
        sends: tuple[int, ...] = (),
        recvs: tuple[int, ...] = (),
        nbytes: int = 0,
        filled: int = 0,
    ) -> None:
        self.events.append(Event(op, _ranks(group), sends, recvs, nbytes, filled, self.segment))

    def waited(self, seconds: float) -> None:
        self.wait_s[self.segment] += seconds

    def mark(self, segment: str) -> None:
        """Later events belong to ``segment``."""
        self.segment = segment

    def mark_layers(self, layers: Sequence[torch.nn.Module]) -> list[Any]:
        """Mark ``fwd{i}`` when decoder layer i's forward starts, ``bwd{i}`` when the gradient of its
        output arrives (its backward starts; it ends before layer i-1's starts), ``head`` after the
        last forward. Returns the hook handles."""
        handles = []
        for i, layer in enumerate(layers):

            def before(module: Any, args: Any, *, i: int = i) -> None:
                self.mark(f"fwd{i}")

            def after(module: Any, args: Any, output: Any, *, i: int = i) -> None:
                hidden = output[0] if isinstance(output, tuple) else output
                if hidden.requires_grad:
                    hidden.register_hook(lambda grad, i=i: self.mark(f"bwd{i}"))
                self.mark("head")

            handles += [layer.register_forward_pre_hook(before), layer.register_forward_hook(after)]
        return handles

    @contextmanager
    def installed(self) -> Iterator[Census]:
        """Count the platform's calls into its process group while inside."""
        saved = torch_collectives.dist, torch_collectives._all_gather_single
        real_gather = saved[1]

        def all_gather(out: torch.Tensor, x: torch.Tensor, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            world = dist.get_world_size(group)
            self.log("all_gather", group, nbytes=_nbytes(x) * (world - 1), filled=_nbytes(out))
            return counting._timed(real_gather, out, x, **kwargs)

        counting = _CountingDist(self)
        torch_collectives.dist, torch_collectives._all_gather_single = counting, all_gather
        try:
            yield self
        finally:
            torch_collectives.dist, torch_collectives._all_gather_single = saved

    def in_segments(self, prefix: str) -> list[Event]:
        return [e for e in self.events if e.segment.startswith(prefix)]


def critical_rounds(
    logs: Sequence[Sequence[Event]], *, weight: Callable[[int], int] = lambda size: 1
) -> list[int]:
    """Replay every rank's ``logs`` (rank r's events in order): each rank's round count when its
    events end (the longest chain of messages and collectives behind it). A message's receiver
    is one round past its sender at the send; a collective of g ranks ends ``weight(g)`` rounds
    after its last member arrived (1; ``g - 1`` prices it as a ring, as the cost model does)."""
    n = len(logs)
    depth, pos = [0] * n, [0] * n
    posted = [False] * n  # the sends of the event at pos already posted
    channels: dict[tuple, deque[int]] = defaultdict(deque)
    seq: list[dict[tuple, int]] = [defaultdict(int) for _ in range(n)]
    arrived: dict[tuple, dict[int, int]] = defaultdict(dict)
    moved = True
    while moved:
        moved = False
        for r in range(n):
            while pos[r] < len(logs[r]):
                e = logs[r][pos[r]]
                if e.op in COLLECTIVES:
                    key = (e.group, seq[r][e.group])
                    arrived[key][r] = depth[r]
                    if len(arrived[key]) < len(e.group):
                        break
                    depth[r] = max(arrived[key].values()) + weight(len(e.group))
                    seq[r][e.group] += 1
                else:
                    if not posted[r]:
                        for peer in e.sends:
                            channels[(e.group, r, peer)].append(depth[r])
                        posted[r] = True
                    if any(not channels[(e.group, peer, r)] for peer in e.recvs):
                        break
                    got = [channels[(e.group, peer, r)].popleft() + 1 for peer in e.recvs]
                    depth[r] = max([depth[r], *got])
                    posted[r] = False
                pos[r] += 1
                moved = True
    stuck = [r for r in range(n) if pos[r] < len(logs[r])]
    if stuck:
        raise AssertionError(f"ranks {stuck} wait for messages no rank sends: the logs do not match")
    return depth
