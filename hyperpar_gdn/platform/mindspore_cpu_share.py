"""Each MindSpore CPU worker's share of the machine: its cores and its kernel threads.

MindSpore 2.10 runs CPU kernels on its own thread pool, not OpenMP, so ``OMP_NUM_THREADS`` does
not bound it. The pool starts at the first kernel with at least two threads (``ActorThread_0``
and ``KernelThread_0``; ``threads_num`` only adds kernel threads, up to the machine's core
count) and large kernels are split over all of them. A worker therefore uses more than one core
whenever one is free: on 2 cores the lone worker of a one-process reference ran at up to 190%,
and two msrun workers, each with three busy threads (Python plus the pool), fought over the two
cores (docs/backends.md has the per-thread measurements). Receives and barriers sleep; they do
not spin.

:func:`plan_cpu_share` decides, from the launcher's numbers and two environment variables, what
:func:`apply_cpu_share` then does in the worker:

- ``HP_MINDSPORE_THREADS`` (a positive integer): the CPU kernel threads of each worker
  (``mindspore.device_context.cpu.op_tuning.threads_num``). Default under a launcher: the
  worker's share of the cores, ``max(1, usable cores // workers on this node)``; without a
  launcher MindSpore's own default.
- ``HP_MINDSPORE_BIND`` (``1`` or ``0``): bind every thread of the worker to its share of the
  cores, consecutive blocks of ``usable cores // workers on this node`` in local rank order.
  Default ``1`` under a launcher with two or more workers on this node when the process may use
  every core of the machine and there is at least one core per worker; ``0`` otherwise (one
  process, or a launcher, ``taskset`` or container that already restricted the cores).

A threads count set in the program before the platform starts
(``threads_num``) is kept. Run on CPU only; on Ascend the platform changes nothing.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["BIND_VAR", "THREADS_VAR", "CpuShare", "apply_cpu_share", "plan_cpu_share", "read_cpu_share_env"]

THREADS_VAR = "HP_MINDSPORE_THREADS"
BIND_VAR = "HP_MINDSPORE_BIND"
_POOL_THREADS = ("ActorThread_", "KernelThread_")  # MindSpore's CPU thread pool, by thread name


@dataclass(frozen=True)
class CpuShare:
    """What one worker gets.

    Attributes:
        threads: CPU kernel threads to ask MindSpore for (None: leave MindSpore's choice).
        cpus: the cores to bind every thread of the process to (None: no binding).
        threads_asked: ``threads`` came from ``HP_MINDSPORE_THREADS`` (then it must take effect).
    """

    threads: int | None
    cpus: tuple[int, ...] | None
    threads_asked: bool = False


def read_cpu_share_env(environ: Mapping[str, str]) -> tuple[int | None, bool | None]:
    """(``HP_MINDSPORE_THREADS``, ``HP_MINDSPORE_BIND``) from ``environ``; None where unset.
    A bad value is a ``ValueError`` naming the variable, its value and the rule."""
    threads: int | None = None
    bind: bool | None = None
    raw = environ.get(THREADS_VAR, "").strip()
    if raw:
        try:
            threads = int(raw)
        except ValueError:
            threads = 0
        if threads < 1:
            raise ValueError(
                f"{THREADS_VAR}={raw!r} must be a positive integer (CPU kernel threads per MindSpore "
                "process) or unset"
            )
    raw = environ.get(BIND_VAR, "").strip()
    if raw:
        if raw not in ("0", "1"):
            raise ValueError(
                f"{BIND_VAR}={raw!r} must be 1 (bind each worker to its share of the cores), "
                "0 (no binding) or unset"
            )
        bind = raw == "1"
    return threads, bind


def plan_cpu_share(
    *,
    environ: Mapping[str, str],
    usable_cpus: Sequence[int],
    online_cpus: int,
    local_rank: int,
    local_size: int,
    launched: bool,
) -> CpuShare:
    """This worker's :class:`CpuShare` (the rules are in the module docstring).

    Args:
        environ: the environment (``HP_MINDSPORE_THREADS``, ``HP_MINDSPORE_BIND``).
        usable_cpus: the cores this process may run on (``os.sched_getaffinity(0)``).
        online_cpus: the machine's cores (``os.cpu_count()``).
        local_rank, local_size: this worker's rank among the workers on this node, and their number.
        launched: started by a launcher (msrun) rather than alone.
    """
    if not 0 <= local_rank < local_size:
        raise ValueError(f"local_rank={local_rank} must be in [0, local_size={local_size})")
    threads, bind = read_cpu_share_env(environ)
    cpus = sorted(usable_cpus)
    share = len(cpus) // local_size
    if bind is None:
        bind = launched and local_size >= 2 and share >= 1 and len(cpus) >= online_cpus
    elif bind and share < 1:
        raise ValueError(
            f"{BIND_VAR}=1 needs a core per worker: {local_size} workers on this node, "
            f"{len(cpus)} usable cores"
        )
    asked = threads is not None
    if threads is None and launched:
        threads = max(1, share)
    bound = tuple(cpus[local_rank * share : (local_rank + 1) * share]) if bind else None
    return CpuShare(threads=threads, cpus=bound, threads_asked=asked)


def _pool_started() -> bool:
    """MindSpore's CPU thread pool exists in this process (a kernel already ran)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().startswith(_POOL_THREADS):
                    return True
        except OSError:
            continue
    return False


def apply_cpu_share(share: CpuShare) -> CpuShare:
    """Ask MindSpore for ``share.threads`` kernel threads and bind every thread of this process
    to ``share.cpus`` (threads started later inherit it). Returns what took effect: ``threads``
    is None where the program had already set its own count or a kernel had already started the
    pool (the count is fixed then); the binding always applies. A count asked for through
    ``HP_MINDSPORE_THREADS`` that cannot take effect is a ``RuntimeError``."""
    import mindspore as ms

    applied = share.threads
    why = ""
    if applied is not None:
        if _pool_started():
            applied, why = None, "a MindSpore kernel ran before the platform started (the pool is fixed then)"
        else:
            try:
                ms.device_context.cpu.op_tuning.threads_num(applied)
            except RuntimeError:  # the program set its own count first: keep it
                applied, why = (
                    None,
                    "the program already set mindspore.device_context.cpu.op_tuning.threads_num",
                )
    if share.threads_asked and applied is None:
        raise RuntimeError(
            f"{THREADS_VAR}={share.threads} cannot take effect: {why}; start the platform "
            f"(init_distributed / init_device_mesh) first, or unset {THREADS_VAR}"
        )
    if share.cpus is not None:
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), share.cpus)
            except (ProcessLookupError, FileNotFoundError):  # a thread that ended meanwhile
                continue
    return CpuShare(threads=applied, cpus=share.cpus, threads_asked=share.threads_asked)
