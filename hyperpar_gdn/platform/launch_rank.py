"""The rank side of :mod:`hyperpar_gdn.platform.launch`: what each forked rank runs.

:class:`RankJob` is what a rank inherits through ``fork`` (never pickled); :func:`rank_main` sets
the rank's environment and threads, joins the platform's default process group, runs the worker
and sends ``("ok", value)`` or ``("error", traceback)`` back through a pipe. :func:`start_store_host`
forks the helper that hosts a TCPStore for the ``env://`` rendezvous (torchrun's agent's role).
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["RankJob", "rank_main", "start_store_host"]


@dataclass(frozen=True)
class RankJob:
    """What every rank needs (inherited through fork, never pickled)."""

    worker: Callable[..., Any]
    args: tuple[Any, ...]
    world_size: int
    threads: int
    pg_timeout_s: float
    init: bool
    rendezvous: str
    job_dir: str
    release: Any  # a multiprocessing Event: set once the parent holds every result

    def stack_file(self, rank: int) -> str:
        return os.path.join(self.job_dir, f"rank{rank}.stacks")

    @property
    def store_file(self) -> str:
        return os.path.join(self.job_dir, "filestore")


def start_store_host(context: Any, timeout_s: float) -> tuple[Any, int]:
    """Fork a process that hosts the job's TCPStore on a free port; return it and the port.

    A helper rather than the parent, so that ranks are never forked while a store server thread
    is running. It exits when killed or when the parent is gone.
    """
    reader, writer = context.Pipe(duplex=False)
    host = context.Process(
        target=_host_store, args=(writer, timeout_s, os.getpid()), name="store", daemon=True
    )
    host.start()
    writer.close()
    try:
        if not reader.poll(30):
            raise RuntimeError("the TCPStore host did not report its port within 30 s")
        port = reader.recv()
    except BaseException:
        host.kill()
        raise
    finally:
        reader.close()
    if not isinstance(port, int):
        host.kill()
        raise RuntimeError(f"the TCPStore host failed:\n{port}")
    return host, port


def _host_store(conn: Connection, timeout_s: float, parent_pid: int) -> None:
    try:
        import torch.distributed as dist

        store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
        )
        conn.send(store.port)
    except BaseException:
        conn.send(traceback.format_exc())
        return
    finally:
        conn.close()
    while os.getppid() == parent_pid:  # serve until killed, or until the parent is gone
        time.sleep(1.0)


def rank_main(job: RankJob, rank: int, env: dict[str, str], conn: Connection) -> None:
    """One rank: environment, threads, process group, barrier, ``job.worker``, result to ``conn``."""
    platform = None
    stacks = open(job.stack_file(rank), "w")  # faulthandler writes here until the process ends
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    try:
        os.environ.update(env)
        import torch

        torch.set_num_threads(job.threads)
        from hyperpar_gdn.platform import get_platform

        platform = get_platform(os.environ["HP_PLATFORM"])
        if job.init and job.rendezvous == "file" and platform.name in ("cpu", "cuda", "npu"):
            import torch.distributed as dist

            store = dist.FileStore(job.store_file, job.world_size)
            platform.init_distributed(timeout_s=job.pg_timeout_s, store=store)  # type: ignore[call-arg]
        elif job.init:
            platform.init_distributed(timeout_s=job.pg_timeout_s)
        if job.init:
            # Every rank has finished connecting before any worker runs (and may fail and exit).
            platform.collectives.barrier(None)
        message: tuple[str, Any] = ("ok", job.worker(rank, job.world_size, *job.args))
    except BaseException:
        message = ("error", traceback.format_exc())
    try:
        # Plain pickle, not Connection.send: torch registers shared-memory reducers with
        # multiprocessing's pickler, and tensors sent that way cannot be rebuilt once this
        # process has exited.
        conn.send_bytes(pickle.dumps(message))
    except Exception:
        failure = f"rank {rank} could not send its result back:\n{traceback.format_exc()}"
        conn.send_bytes(pickle.dumps(("error", failure)))
    finally:
        conn.close()
        sys.stdout.flush()
        sys.stderr.flush()
    # A rank that succeeded stays until every rank has reported: exiting closes its sockets, and
    # peers still setting up a gloo group with it would fail with "Connection closed by peer". A
    # rank that failed leaves at once, so that peers blocked on it fail fast with their own error.
    if message[0] == "ok":
        job.release.wait(job.pg_timeout_s)
    if platform is not None:
        try:
            platform.destroy()
        except Exception:
            pass
