"""The trainer's checkpoint saves, in either format, and how every rank learns that a write failed.

Whole (format 1, :mod:`.whole`): the backend's state dicts gathered on rank 0, which writes
them. Sharded (format 2, :mod:`.sharded`): every rank writes its own shard into the
hidden temporary directory that rank 0 prepared (named with rank 0's pid, which every rank learns
by a reduction); once all shards are written, rank 0 commits (checksums, manifest, rename). With
``--async-save`` the shards are copied to host memory at the step, written by a background thread
while training goes on, and committed at the next save or at the end of the run
(:meth:`CheckpointWriter.finish`): until then the checkpoint is invisible.

A failure anywhere reaches every rank through one reduction (:func:`settle`), before the next
collective, so none waits forever; a write the system refused follows ``--on-save-error``.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from hyperpar_gdn.train.backends.base import TrainBackend
from hyperpar_gdn.train.checkpoints.whole import nonfinite_entries, save_checkpoint, serialize_parts
from hyperpar_gdn.train.checkpoints.directory import os_error_behind, prune_checkpoints
from hyperpar_gdn.train.errors import CheckpointError
from hyperpar_gdn.train.config import TrainConfig
from hyperpar_gdn.train.loop.faults import SaveError
from hyperpar_gdn.train.loop.log import logger

__all__ = ["CheckpointWriter", "on_rank_0", "settle"]

# What a failed write raises: DCP gathers every rank's failures into a CheckpointException, which
# is a BaseException (not caught by ``except Exception``); KeyboardInterrupt and SIGTERM pass.
_FAILURES = (Exception, CheckpointException)


def settle(
    failure: BaseException | None,
    what: str,
    *,
    backend: TrainBackend,
    policy: str,
    cleanup: Callable[[], None] | None = None,
) -> bool:
    """Collective: whether ``what`` succeeded on every rank (``failure``: this rank's exception).

    A write the system refused (an ``OSError``, also inside DCP's per-rank failures) follows
    ``policy``: "stop" raises :class:`SaveError` on every rank, "continue" warns and returns False.
    Other failures raise (this rank's own, or a :class:`CheckpointError` naming ``what``). Rank 0
    runs ``cleanup`` (removing a partial directory) before either."""
    if failure is not None and (stop := _stop_inside(failure)) is not None:
        raise stop from None  # before any collective: the other ranks are stopping too
    code = 0 if failure is None else 1 if _refused_write(failure) else 2
    code = backend.max_over_ranks(code)
    if code == 0:
        return True
    if cleanup is not None and backend.rank == 0:
        cleanup()
    if code == 2:
        if isinstance(failure, CheckpointException):  # its text is tracebacks: one line instead
            raise CheckpointError(f"could not {what}: {_one_line(failure)}") from failure
        if failure is not None:
            raise failure
        raise CheckpointError(f"another rank failed to {what}")
    cause = f": {_one_line(failure)}" if failure is not None else " (rank 0's line says why)"
    line = (
        f"{'rank 0 ' if failure is None else ''}could not {what}{cause}; the checkpoints before "
        f"it are intact and no partial directory is left (--on-save-error {policy})"
    )
    if policy == "stop":
        raise SaveError(line) from failure
    logger.warning("%s; continuing", line)
    return False


def on_rank_0(work: Callable[[], Any], what: str, *, backend: TrainBackend, policy: str) -> bool:
    """Run ``work()`` on rank 0 and :func:`settle` it on every rank."""
    failure: BaseException | None = None
    if backend.rank == 0:
        try:
            work()
        except Exception as err:
            failure = err
    return settle(failure, what, backend=backend, policy=policy)


@dataclass
class _Pending:
    """A sharded save whose shards are being (or were) written, not yet committed."""

    step: int
    temp: Path
    blobs: dict[str, bytes]  # rank 0: the small parts, serialized at the step
    future: Future | None


class CheckpointWriter:
    """Saves of one run in ``fmt`` ("sharded" or "whole"); ``meta`` goes into each manifest."""

    def __init__(self, config: TrainConfig, backend: TrainBackend, *, fmt: str, meta: dict[str, Any]) -> None:
        self.config, self.backend, self.fmt, self.meta = config, backend, fmt, meta
        self.pending: _Pending | None = None

    def save(self, step: int, small: dict[str, Any]) -> None:
        """Collective: save ``step`` with the backend's state and the ``small`` parts (``data``,
        ``train``: the same on every rank; rank 0's are written)."""
        if self.fmt == "whole":
            self._save_whole(step, small)
            return
        self.finish()  # the save before this one is committed first
        self._start_sharded(step, small)
        if not self.config.async_save:
            self.finish()

    def finish(self) -> None:
        """Collective: wait for the pending sharded save, if any, and commit it on rank 0."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        failure: BaseException | None = None
        if pending.future is not None:
            try:
                pending.future.result()
            except _FAILURES as err:
                failure = err
        what = self._what(pending.step)
        if not self._settle(failure, what, pending.temp):
            return

        def commit() -> None:
            from hyperpar_gdn.train.checkpoints.sharded import commit_sharded

            directory = Path(self.config.save) / f"step-{pending.step}"
            path = commit_sharded(
                pending.temp,
                directory,
                step=pending.step,
                meta=self.meta,
                blobs=pending.blobs,
                layout=self.backend.shard_layout,
            )
            logger.info("saved %s (sharded)", path)
            self._prune(pending.step)

        on_rank_0(commit, what, backend=self.backend, policy=self.config.on_save_error)

    def abandon(self, *, timeout_s: float) -> None:
        """Leave a pending save uncommitted (the run stopped early): wait up to ``timeout_s`` for
        its thread, so that it does not outlive the process group; its hidden directory stays,
        invisible, until the next run's scan removes it."""
        pending, self.pending = self.pending, None
        if pending is not None and pending.future is not None:
            try:
                pending.future.result(timeout=timeout_s)
            except _FAILURES as err:
                logger.warning("the unfinished step-%d save ended with %s", pending.step, _one_line(err))

    # --- the two formats ----------------------------------------------------------------------------
    def _save_whole(self, step: int, small: dict[str, Any]) -> None:
        parts = {**self.backend.state_dict(), **small}  # every rank: gathering FSDP shards is collective

        def save() -> None:  # the other ranks wait in on_rank_0 until step-N is renamed into place
            if bad := nonfinite_entries({"model": parts["model"], "optimizer": parts["optimizer"]}):
                raise CheckpointError(
                    f"refusing to save step-{step}: {', '.join(bad[:3])} hold NaN or inf values"
                )
            path = save_checkpoint(self.config.save, step, parts, meta=self.meta)
            logger.info("saved %s", path)
            self._prune(step)

        on_rank_0(save, self._what(step), backend=self.backend, policy=self.config.on_save_error)

    def _start_sharded(self, step: int, small: dict[str, Any]) -> None:
        backend, root = self.backend, Path(self.config.save)
        pid = backend.max_over_ranks(os.getpid() if backend.rank == 0 else 0)
        temp = root / f".step-{step}.tmp-{pid}"
        what = self._what(step)

        def prepare() -> None:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(temp, ignore_errors=True)
            temp.mkdir()

        if not on_rank_0(prepare, what, backend=backend, policy=self.config.on_save_error):
            return
        blobs = serialize_parts(small) if backend.rank == 0 else {}
        failure: BaseException | None = None
        future = None
        try:
            future = backend.save_shards(temp, background=self.config.async_save)
        except _FAILURES as err:
            failure = err
        if self._settle(failure, what, temp):
            self.pending = _Pending(step, temp, blobs, future)
            if self.config.async_save:
                logger.info("writing the step-%d shards in the background", step)

    # --- helpers ------------------------------------------------------------------------------------
    def _settle(self, failure: BaseException | None, what: str, temp: Path) -> bool:
        return settle(
            failure,
            what,
            backend=self.backend,
            policy=self.config.on_save_error,
            cleanup=lambda: shutil.rmtree(temp, ignore_errors=True),
        )

    def _what(self, step: int) -> str:
        return f"save the step-{step} checkpoint under {self.config.save}"

    def _prune(self, step: int) -> None:
        if self.config.keep_last:
            for old in prune_checkpoints(self.config.save, self.config.keep_last, up_to=step):
                logger.info("removed %s (--keep-last %d)", old, self.config.keep_last)


def _stop_inside(err: BaseException) -> BaseException | None:
    """A stop request (Ctrl-C's ``KeyboardInterrupt``, SIGTERM's ``Stopped``: not ``Exception``s)
    that DCP caught during its write and wrapped, with every rank's failures, in a
    CheckpointException: the run is stopping, not failing to save."""
    for _, failure in _rank_failures(err):
        if not isinstance(failure, Exception):
            return failure
    return None


def _refused_write(err: BaseException) -> bool:
    """An ``OSError`` (or one behind ``err``: torch's serializer reports a failed write as a
    ``RuntimeError`` whose context is the ``OSError``), also inside DCP's per-rank failures."""
    return os_error_behind(err) is not None or any(
        os_error_behind(e) is not None for _, e in _rank_failures(err)
    )


def _one_line(err: BaseException) -> str:
    """``err`` in one line: DCP's multi-line exception becomes its first rank's failure, and a
    write's ``OSError`` is named rather than what it caused."""
    if failures := _rank_failures(err):
        rank, first = failures[0]
        cause = os_error_behind(first) or first
        return f"rank {rank}: {type(cause).__name__}: {cause}".splitlines()[0]
    cause = os_error_behind(err) or err
    return str(cause).splitlines()[0] if str(cause) else type(cause).__name__


def _rank_failures(err: BaseException) -> list[tuple[int, BaseException]]:
    """(rank, exception) of each rank's failure inside a CheckpointException, by rank."""
    if not isinstance(err, CheckpointException):
        return []
    found = []
    for rank, failure in sorted(err.failures.items(), key=lambda item: item[0]):
        found.append((rank, failure[0] if isinstance(failure, tuple) else failure))
    return found
