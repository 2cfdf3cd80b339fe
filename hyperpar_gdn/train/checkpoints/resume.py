"""Where a run starts: ``--resume PATH``, the newest complete checkpoint under ``--save`` (auto
resume), or step 1; and the checks that a checkpoint suits this run.

Auto resume is decided by rank 0 alone: it removes what saves that died left behind, scans the
root (falling back past a damaged newest checkpoint) and tells the others which step it took; they
load that directory, which is complete (a ``step-N`` appears only by a rename once all of it is on
disk). Every rank learns of a failure on any rank before the next collective, so none waits forever.
No framework here: the trainer passes its backend's ``max_over_ranks``.

A sharded checkpoint (format 2, either layout of its state) is read here only for its small
parts; rank 0's scan checks that its shard files are there with their sizes, then every rank
checksums its share of them (:func:`~.sharded.verify_shards`): a damaged newest one is
skipped as in the whole format (auto resume), or is the error naming the file (``--resume``).
The backend then loads the shards into its own layout (:attr:`ResumePoint.shards`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hyperpar_gdn.train.checkpoints.whole import latest_checkpoint, load_checkpoint
from hyperpar_gdn.train.checkpoints.directory import DCP_LAYOUT, SHARDED_FORMAT, list_checkpoints, read_manifest, remove_incomplete, resolve_checkpoint, shard_layout
from hyperpar_gdn.train.errors import CheckpointError
from hyperpar_gdn.train.config import TrainConfig
from hyperpar_gdn.train.loop.log import logger

__all__ = ["ResumePoint", "find_resume_point"]

# Options a resumed run must share with its checkpoint to draw the same batches and shapes.
SAME_STREAM = ("model_size", "model_dir", "seq_len", "batch_size", "seed", "data")
# Options that change the loss curve if they differ (a warning only).
SAME_CURVE = ("lr", "warmup_steps", "weight_decay", "grad_clip", "doc_boundaries", "dtype")


@dataclass(frozen=True)
class ResumePoint:
    """A checkpoint this run continues from, checked against its options.

    Attributes:
        path: the ``step-N`` directory (or what ``--resume`` named).
        step: the step it was saved at.
        parts: its named parts (``model``, ``optimizer``, ``data``, ``train``; a sharded
            checkpoint's are ``data`` and ``train`` only).
        shards: a sharded checkpoint's state directory (``step-N/state``), holding the model and
            optimizer state; None for a whole checkpoint.
        layout: how ``shards`` is laid out (``.checkpoint.SHARD_LAYOUTS``; unused without shards).
    """

    path: str
    step: int
    parts: dict[str, Any]
    shards: str | None = None
    layout: str = DCP_LAYOUT


def find_resume_point(
    config: TrainConfig, *, rank: int, world_size: int, max_over_ranks: Callable[[int], int]
) -> ResumePoint | None:
    """The checkpoint to continue from (``--resume``, else auto resume under ``--save``), checked
    (:func:`check_options`); None: train from step 1. Collective when ``--save`` is given or the
    checkpoint is sharded."""
    if config.resume is not None:
        step, parts, meta = load_checkpoint(config.resume, whole_state=False)
        check_options(config, config.resume, step, meta, rank=rank, auto=False)
        directory = resolve_checkpoint(config.resume)
        shards = _shards_of(directory)
        if shards is not None:
            bad = _verify(directory, rank=rank, world_size=world_size, max_over_ranks=max_over_ranks)
            if bad is not None:
                raise CheckpointError(bad)
        return ResumePoint(config.resume, step, parts, shards, _layout_of(directory, shards))
    if config.save is None:
        return None
    damaged: set[int] = set()
    while True:
        found = _newest_under(config, config.save, rank=rank, max_over_ranks=max_over_ranks, skip=damaged)
        if found is None:
            return None
        path, (step, parts, meta) = found
        shards = _shards_of(Path(path))
        if shards is not None:
            bad = _verify(Path(path), rank=rank, world_size=world_size, max_over_ranks=max_over_ranks)
            if bad is not None:
                if rank == 0:
                    logger.warning("skipping checkpoint %s: %s; trying the one before it", path, bad)
                damaged.add(step)
                continue
        check_options(config, path, step, meta, rank=rank, auto=True)
        return ResumePoint(path, step, parts, shards, _layout_of(Path(path), shards))


def _verify(directory: Path, **collective: Any) -> str | None:
    from hyperpar_gdn.train.checkpoints.sharded import verify_shards  # torch's DCP: imported when needed

    return verify_shards(directory, **collective)


def _shards_of(directory: Path) -> str | None:
    """The DCP directory of a sharded checkpoint; None for a whole one."""
    if read_manifest(directory)["format"] != SHARDED_FORMAT:
        return None
    from hyperpar_gdn.train.checkpoints.sharded import STATE_DIR

    return str(directory / STATE_DIR)


def _layout_of(directory: Path, shards: str | None) -> str:
    return DCP_LAYOUT if shards is None else shard_layout(read_manifest(directory))


def check_options(
    config: TrainConfig, path: str, step: int, meta: dict[str, Any], *, rank: int, auto: bool
) -> None:
    """Refuse a checkpoint written with other data or shapes, or with nothing left to train; warn
    (rank 0) when options that shape the loss curve changed."""
    saved = meta.get("config", {})
    mine = config.to_dict()

    def changed(names: tuple[str, ...]) -> list[str]:
        return [
            f"--{k.replace('_', '-')} {saved.get(k)!r} (now {mine[k]!r})"
            for k in names
            if saved.get(k) != mine[k]
        ]

    if stream := changed(SAME_STREAM):
        raise ValueError(
            f"checkpoint {path} was written by a run with different data or shapes: {'; '.join(stream)}"
        )
    if (curve := changed(SAME_CURVE)) and rank == 0:
        logger.warning("resuming with changed options, the loss curve will differ: %s", "; ".join(curve))
    if step >= config.steps:
        how = "the newest checkpoint under --save," if auto else "--resume"
        raise ValueError(
            f"{how} {path} is at step {step}; --steps {config.steps} leaves nothing to train"
            + (" (raise --steps, or pass --no-auto-resume to start over)" if auto else "")
        )


def _newest_under(
    config: TrainConfig,
    root: str,
    *,
    rank: int,
    max_over_ranks: Callable[[int], int],
    skip: set[int],
) -> tuple[str, tuple[int, dict[str, Any], dict[str, Any]]] | None:
    """Rank 0 scans ``root`` (passing over the steps in ``skip``) and every rank loads the step
    it took (see the module docstring)."""
    found: tuple[Path, int, dict[str, Any], dict[str, Any]] | None = None
    failure: Exception | None = None
    code = 0  # rank 0's verdict: 0 failed, 1 no checkpoint, 2 + N resume from step-N
    if rank == 0:
        try:
            found = _scan(config, root, skip=frozenset(skip))
            code = 1 if found is None else 2 + found[1]
        except Exception as err:
            found, code, failure = None, 0, err
    code = max_over_ranks(code)
    if code == 0:
        if failure is not None:
            raise failure
        raise CheckpointError(f"rank 0 failed to look for checkpoints under --save {root}")
    if code == 1:
        if not skip:
            _log_fresh_start(config, root, rank=rank)
        return None
    path = Path(root) / f"step-{code - 2}"
    loaded = None if found is None else (found[1], found[2], found[3])
    if loaded is None:
        try:
            loaded = load_checkpoint(path, whole_state=False)
        except CheckpointError as err:
            logger.error("%s", err)
    if max_over_ranks(int(loaded is None)):
        raise CheckpointError(
            f"a rank could not read {path}, which rank 0 checked (do all ranks see the same --save directory?)"
        )
    assert loaded is not None
    logger.info("resuming from %s (the newest complete checkpoint under --save)", path)
    return str(path), loaded


def _scan(
    config: TrainConfig, root: str, *, skip: frozenset[int]
) -> tuple[Path, int, dict[str, Any], dict[str, Any]] | None:
    """Rank 0: remove dead saves, then the newest checkpoint that passes its checks (or None)."""
    if not skip:
        for leftover in remove_incomplete(root):
            logger.warning("removed %s: a save that did not finish", leftover)
    if not config.auto_resume:
        return None
    found = latest_checkpoint(root, warn=logger.warning, whole_state=False, skip=skip)
    if found is None and (damaged := list_checkpoints(root)):
        raise CheckpointError(
            f"every checkpoint under --save {root} ({', '.join(d.name for _, d in damaged)}) "
            "failed its checks (see the warnings above); repair or move them, or pass "
            "--no-auto-resume to start over"
        )
    return found


def _log_fresh_start(config: TrainConfig, root: str, *, rank: int) -> None:
    existing = list_checkpoints(root) if rank == 0 else []
    if existing:  # only under --no-auto-resume
        logger.warning(
            "--no-auto-resume: training from step 1; --save %s already holds %s from an earlier "
            "run: this run replaces those it saves again, and a run that resumes from %s takes "
            "the newest there",
            root,
            ", ".join(d.name for _, d in existing),
            root,
        )
    else:
        logger.info("no checkpoint under --save %s: training from step 1", root)
