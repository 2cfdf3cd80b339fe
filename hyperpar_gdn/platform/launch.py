"""Start N ranks of a function on this machine with a real process group; collect their results.

:func:`run_ranks` forks ``world_size`` processes, gives each torchrun's environment, joins the
platform's default process group (gloo on CPU), calls ``worker(rank, world_size, *args)`` and
returns the per-rank return values in rank order. The tests and the benchmarks use it; so can a
user who wants to try a CP setup on one machine without ``torchrun``. Nothing hangs: the job has
a deadline (``timeout_s``) after which every rank is killed, and every collective has the
process-group timeout (``pg_timeout_s``)::

    import torch
    from hyperpar_gdn.platform import get_platform
    from hyperpar_gdn.platform.launch import run_ranks

    def gather(rank: int, world_size: int, scale: float) -> list[float]:
        x = torch.full((1,), scale * rank)
        return get_platform().collectives.all_gather(x, None).flatten().tolist()

    assert run_ranks(gather, 4, 2.0, timeout_s=30) == [[0.0, 2.0, 4.0, 6.0]] * 4

The worker runs in a forked child, so it may be a closure; its arguments are inherited, not
pickled; its return value is pickled (torch tensors travel by value). Before the worker runs,
every rank has joined the group and passed a barrier; a rank that returned waits until every rank
has reported.

Failures: :func:`run_ranks` raises :class:`RanksFailed` (an ``AssertionError``) holding every
failing rank's traceback; a rank that exits without a result (``os._exit``, a signal) is recorded
as dead with its exit code; a rank still running at the deadline is killed and its Python stacks
(faulthandler, SIGUSR1) are in the message. After the first failure the others get ``grace_s``
seconds. :func:`launch_ranks` returns the :class:`RankOutcome` instead of raising (to test
failures on purpose).

Environment of each rank: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``OMP_NUM_THREADS=threads`` (and ``torch.set_num_threads(threads)``), ``HP_PLATFORM=cpu``;
``env`` overrides or adds variables. ``init=False`` starts the worker without a process group.

Rendezvous: ``"file"`` (default, torch platforms) meets through a ``FileStore`` in the job's
temporary folder; ``"env"`` is torchrun's ``env://`` path (``MASTER_ADDR``/``MASTER_PORT`` of a
TCPStore that a helper process hosts on a free port, ``TORCHELASTIC_USE_AGENT_STORE=True``).
Measured here: c10d's TCP store resolves every peer address backwards, and this machine's DNS
server drops a few of those queries, so between 1 job in 20 and 1 in 4 stalled for 5 s; the file
store does no lookups. The parent must not own a default process group (forked ranks would
inherit a broken copy). A 4-rank gloo job starts, joins and ends in about 0.15 s here.

MindSpore ranks are not forked: MCCL needs the scheduler and workers that ``msrun`` starts; see
:mod:`hyperpar_gdn.platform.msrun`.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from hyperpar_gdn.platform.launch_rank import RankJob, rank_main, start_store_host

__all__ = ["RankOutcome", "RanksFailed", "launch_ranks", "run_ranks"]


@dataclass
class RankOutcome:
    """What each rank of a job did.

    Attributes:
        world_size: the number of ranks.
        results: rank -> the worker's return value, for ranks that returned.
        errors: rank -> formatted traceback, for ranks whose worker (or setup) raised.
        dead: rank -> exit code (negative: killed by that signal), for ranks that exited without
            sending a result or an error.
        timed_out: ranks still running at the deadline (or after the grace period that follows
            the first failure); they were killed.
        stacks: rank -> the Python stacks (all threads) of a timed-out rank just before it was
            killed, to show where it hung.
        wall_s: seconds from the first fork until every child was gone.
    """

    world_size: int
    results: dict[int, Any] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    dead: dict[int, int | None] = field(default_factory=dict)
    timed_out: list[int] = field(default_factory=list)
    stacks: dict[int, str] = field(default_factory=dict)
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return len(self.results) == self.world_size

    def describe(self) -> str:
        lines = [
            f"{self.world_size} ranks: {len(self.results)} returned, errors on {sorted(self.errors)}, "
            f"dead {self.dead}, timed out {self.timed_out} (after {self.wall_s:.1f} s)"
        ]
        for rank in sorted(self.errors):
            lines.append(f"----- rank {rank} traceback -----\n{self.errors[rank].rstrip()}")
        for rank in sorted(self.stacks):
            lines.append(f"----- rank {rank} stacks when killed -----\n{self.stacks[rank].rstrip()}")
        return "\n".join(lines)


class RanksFailed(AssertionError):
    """Some rank raised, died or timed out; ``outcome`` has the details."""

    def __init__(self, outcome: RankOutcome) -> None:
        super().__init__(outcome.describe())
        self.outcome = outcome


def run_ranks(worker: Callable[..., Any], world_size: int, *args: Any, **options: Any) -> list[Any]:
    """Run ``worker(rank, world_size, *args)`` on ``world_size`` forked ranks; return the list of
    per-rank results in rank order. Raises :class:`RanksFailed` unless every rank returned.
    ``options`` are :func:`launch_ranks`' keywords (``timeout_s``, ``env``, ``threads``, ...)."""
    outcome = launch_ranks(worker, world_size, *args, **options)
    if not outcome.ok:
        raise RanksFailed(outcome)
    return [outcome.results[rank] for rank in range(world_size)]


def launch_ranks(
    worker: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 60.0,
    env: Mapping[str, str] | None = None,
    pg_timeout_s: float = 30.0,
    grace_s: float = 5.0,
    init: bool = True,
    rendezvous: str = "file",
    threads: int = 1,
) -> RankOutcome:
    """Run ``worker(rank, world_size, *args)`` on ``world_size`` forked ranks and return what
    each did (:class:`RankOutcome`), whether or not every rank returned.

    Args:
        timeout_s: deadline for the whole job, start-up included; then every child is killed.
        env: extra or overriding environment variables for the children.
        pg_timeout_s: the process-group timeout (seconds) given to ``init_distributed``.
        grace_s: after the first failure, how long the other ranks may still run.
        init: join the platform's default process group before calling ``worker``.
        rendezvous: ``"file"`` or ``"env"`` (see the module docstring).
        threads: intra-op threads of each rank (``OMP_NUM_THREADS`` and torch's).
    """
    _check_options(world_size, timeout_s, pg_timeout_s, grace_s, rendezvous, threads)
    context = multiprocessing.get_context("fork")
    outcome = RankOutcome(world_size=world_size)
    procs: list[Any] = []
    conns: list[Connection] = []
    job_dir = tempfile.mkdtemp(prefix="hp-ranks-")
    release = context.Event()  # set when the parent has every result: then the ranks may exit
    job = RankJob(worker, args, world_size, threads, pg_timeout_s, init, rendezvous, job_dir, release)
    base_env = {
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "OMP_NUM_THREADS": str(threads),
        "HP_PLATFORM": "cpu",
    }
    store_host = None
    start = time.monotonic()
    try:
        if rendezvous == "env":
            store_host, port = start_store_host(context, pg_timeout_s)
            base_env.update(
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True"
            )
        for rank in range(world_size):
            child_env = {**base_env, "RANK": str(rank), "LOCAL_RANK": str(rank), **(env or {})}
            reader, writer = context.Pipe(duplex=False)
            proc = context.Process(
                target=rank_main, args=(job, rank, child_env, writer), name=f"rank{rank}", daemon=True
            )
            proc.start()
            writer.close()  # only the child writes: its exit gives the parent EOF
            procs.append(proc)
            conns.append(reader)
        _collect(outcome, procs, conns, deadline=start + timeout_s, grace_s=grace_s)
        _dump_stacks(outcome, procs, job)
    finally:
        release.set()
        exit_by = time.monotonic() + 5.0  # ranks that reported leave their group and exit
        for rank, proc in enumerate(procs):
            if rank in outcome.results or rank in outcome.errors:
                proc.join(timeout=max(0.0, exit_by - time.monotonic()))
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(timeout=10)
        for conn in conns:
            conn.close()
        if store_host is not None:
            store_host.kill()
            store_host.join(timeout=10)
        shutil.rmtree(job_dir, ignore_errors=True)
        outcome.wall_s = time.monotonic() - start
    return outcome


def _check_options(
    world_size: int, timeout_s: float, pg_timeout_s: float, grace_s: float, rendezvous: str, threads: int
) -> None:
    """Refuse bad options, and a parent that owns a process group, before any rank starts."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if timeout_s <= 0 or pg_timeout_s <= 0 or grace_s < 0:
        raise ValueError(
            f"timeouts must be positive (grace_s may be 0): timeout_s={timeout_s}, "
            f"pg_timeout_s={pg_timeout_s}, grace_s={grace_s}"
        )
    if rendezvous not in ("file", "env"):
        raise ValueError(f"rendezvous={rendezvous!r} must be 'file' or 'env'")
    if threads < 1:
        raise ValueError(f"threads={threads} must be >= 1")
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(
            "the parent process owns a default process group; forked ranks would inherit a broken "
            "copy. Run single-process distributed code inside run_ranks(..., 1) instead."
        )


def _collect(
    outcome: RankOutcome, procs: list[Any], conns: list[Connection], *, deadline: float, grace_s: float
) -> None:
    """Read every rank's message until all are in, the deadline passes, or the grace period after
    the first failure ends; record the rest as timed out."""
    owner: dict[Any, int] = {}
    for rank, (proc, conn) in enumerate(zip(procs, conns, strict=True)):
        owner[conn] = rank
        owner[proc.sentinel] = rank
    pending = set(range(len(procs)))
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        waitables = [conns[r] for r in pending] + [procs[r].sentinel for r in pending]
        for ready in wait(waitables, timeout=remaining):
            rank = owner[ready]
            if rank not in pending:
                continue
            message = None
            conn = conns[rank]
            if ready is conn or conn.poll():
                try:
                    payload = conn.recv_bytes()
                except (EOFError, OSError):
                    payload = None
                if payload is not None:
                    try:
                        message = pickle.loads(payload)
                    except Exception:
                        message = (
                            "error",
                            f"the parent could not unpickle rank {rank}'s result:\n{traceback.format_exc()}",
                        )
            pending.discard(rank)
            if message is None:
                procs[rank].join(timeout=5)
                outcome.dead[rank] = procs[rank].exitcode
            elif message[0] == "ok":
                outcome.results[rank] = message[1]
            else:
                outcome.errors[rank] = message[1]
            if message is None or message[0] != "ok":
                deadline = min(deadline, time.monotonic() + grace_s)
    outcome.timed_out = sorted(pending)


def _dump_stacks(outcome: RankOutcome, procs: list[Any], job: RankJob) -> None:
    """Ask every timed-out rank still alive for its Python stacks (faulthandler on SIGUSR1)."""
    asked = [rank for rank in outcome.timed_out if procs[rank].is_alive()]
    for rank in asked:
        os.kill(procs[rank].pid, signal.SIGUSR1)
    deadline = time.monotonic() + 2.0
    for rank in asked:
        text = ""
        while time.monotonic() < deadline:
            with open(job.stack_file(rank)) as handle:
                text = handle.read()
            if text.endswith("\n") and "File" in text:
                break
            time.sleep(0.05)
        outcome.stacks[rank] = text or "(no stack: the rank did not answer SIGUSR1)"
