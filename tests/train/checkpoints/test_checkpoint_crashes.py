"""A process killed at any point of a save leaves the newest complete checkpoint loadable.

A save (whole or sharded, a first save of step 2 beside step 1 or a re-save of an existing
step 2, then ``--keep-last 1``) runs in a forked process that exits at once (``os._exit``, as a
SIGKILL would leave it) before its k-th file-system operation (a rename, a directory made or
removed, a file unlinked or flushed), for every k. Each crash is followed by the resume a
restarted run makes (:func:`find_resume_point` under ``--save``, then the state loaded): it
resumes from step 2 with the new state exactly when the save's final rename had happened, and
otherwise from the checkpoint that was newest before the save, whole, with nothing hidden left
behind.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from hyperpar_gdn.train import TrainConfig
from hyperpar_gdn.train.checkpoints.whole import save_checkpoint, serialize_parts
from hyperpar_gdn.train.checkpoints.directory import prune_checkpoints
from hyperpar_gdn.train.checkpoints.resume import find_resume_point
from hyperpar_gdn.train.checkpoints.sharded import commit_sharded, load_shards, sharded_state, write_shards

STEPS = 10  # the runs that resume train up to here
CRASHED = 86  # the exit status of an injected crash
# the file-system operations a crash is injected before
OPERATIONS = (
    (os, "rename"),
    (os, "replace"),
    (os, "mkdir"),
    (os, "rmdir"),
    (os, "unlink"),
    (os, "fsync"),
)


def _model(value: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A tiny model and its AdamW state, every weight ``value`` (the checkpoint's version)."""
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(value)
    return model, optimizer


def _save(fmt: str, root: Path, step: int, value: float) -> None:
    """What one rank's save does in ``fmt``, then ``--keep-last 1``."""
    meta = {"config": TrainConfig(steps=STEPS).to_dict()}
    small = {"train": {"step": step}}
    model, optimizer = _model(value)
    if fmt == "whole":
        save_checkpoint(root, step, {"model": model.state_dict(), **small}, meta=meta)
    else:  # CheckpointWriter's steps on rank 0 of 1
        temp = root / f".step-{step}.tmp-{os.getpid()}"
        temp.mkdir(parents=True)
        write_shards(sharded_state(model, optimizer), temp / "state")
        commit_sharded(temp, root / f"step-{step}", step=step, meta=meta, blobs=serialize_parts(small))
    prune_checkpoints(root, 1, up_to=step)


def _save_crashing(fmt: str, root: Path, value: float, crash_at: int | None, log: Path) -> int:
    """Save step 2 in a forked process that exits before its ``crash_at``-th operation (None:
    never); it writes the operations it made to ``log``. Returns its exit status."""
    pid = os.fork()
    if pid == 0:  # the child: never returns
        status = 1
        try:
            made: list[list[str]] = []
            for module, name in OPERATIONS:
                setattr(module, name, _counted(getattr(module, name), name, made, crash_at))
            _save(fmt, root, 2, value)
            log.write_text(json.dumps(made))
            status = 0
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _counted(real: Any, name: str, made: list[list[str]], crash_at: int | None) -> Any:
    def operation(*args: Any, **kwargs: Any) -> Any:
        if len(made) == crash_at:
            os._exit(CRASHED)
        made.append([name, *map(str, args[:2])])
        return real(*args, **kwargs)

    return operation


def _resume(fmt: str, root: Path) -> tuple[int, float]:
    """The step a restarted run resumes from under ``root``, and the weights' value it loads."""
    point = find_resume_point(
        TrainConfig(steps=STEPS, save=str(root)), rank=0, world_size=1, max_over_ranks=lambda v: v
    )
    assert point is not None
    if fmt == "whole":
        weight = point.parts["model"]["weight"]
    else:
        assert point.shards is not None
        model, optimizer = _model(-1.0)
        load_shards(Path(point.shards), model, optimizer)
        weight = model.weight.detach()
    assert torch.all(weight == weight.flatten()[0]), weight
    return point.step, float(weight.flatten()[0])


@pytest.mark.parametrize("fmt", ["whole", "sharded"])
@pytest.mark.parametrize("resave", [False, True], ids=["first-save", "re-save"])
def test_a_crash_between_any_two_steps_of_a_save_leaves_the_newest_checkpoint(
    tmp_path: Path, fmt: str, resave: bool
) -> None:
    before = tmp_path / "before"
    _save(fmt, before, 1, 1.0)
    if resave:
        os.rename(before / "step-1", before / "keep")  # keep-last 1 removed it: step 1 beside step 2
        _save(fmt, before, 2, 2.0)
        os.rename(before / "keep", before / "step-1")
    old = (2, 2.0) if resave else (1, 1.0)  # the newest complete checkpoint before the save
    new = (2, 3.0)

    whole_run = tmp_path / "whole-run"
    shutil.copytree(before, whole_run)
    assert _save_crashing(fmt, whole_run, 3.0, None, tmp_path / "log.json") == 0
    made = json.loads((tmp_path / "log.json").read_text())
    (commit,) = [
        k for k, (name, *args) in enumerate(made) if name == "rename" and args[1] == str(whole_run / "step-2")
    ]
    results = []
    for k in range(len(made) + 1):  # before every operation, and after the last
        root = tmp_path / f"crash-{k}"
        shutil.copytree(before, root)
        log = tmp_path / f"log-{k}.json"
        status = _save_crashing(fmt, root, 3.0, k if k < len(made) else None, log)
        assert status == (CRASHED if k < len(made) else 0), (k, made[k : k + 1])
        resumed = _resume(fmt, root)
        results.append(resumed)
        assert resumed == (new if k > commit else old), (k, made[k - 1 : k + 1], resumed)
        assert not [p.name for p in root.iterdir() if p.name.startswith(".")], (k, sorted(os.listdir(root)))
    print(
        f"{fmt} {'re-save' if resave else 'first save'}: {len(made)} operations, {len(results)} crash points"
    )
    for k, resumed in enumerate(results):
        before_k = " ".join(made[k]).replace(f"{whole_run}/", "") if k < len(made) else "(none: completed)"
        print(f"  crash before {k:2d} {before_k}: resumed from step-{resumed[0]} holding {resumed[1]}")
