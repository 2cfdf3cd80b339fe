"""Fault injection for tests of the trainer's fault handling: callbacks
(:class:`~hyperpar_gdn.train.loop.callbacks.TrainCallback`) that a test gives the trainer; the training
loop itself knows nothing of them, and ``scripts/train.py`` never installs them (the tests run it
through ``tests/train/train_with_faults.py``, which does). Never use them in a real run.

- :class:`InjectNaN`: this rank's loss scale is NaN at the chosen steps, so that its gradients,
  and after the gradient sync every rank's, are NaN: what an overflow does. From the environment:
  ``HP_TRAIN_INJECT_NAN="STEP[,STEP...][@RANK]"`` (rank RANK, default 0).
- :class:`KillAtStep`: this rank sends itself SIGKILL when it reaches the step, before computing
  it: a worker lost mid-run (a crash or an out-of-memory kill), for the tests of restarts. Only in
  a run that started from step 1, so the restarted run, which resumes from a checkpoint, goes on.
  From the environment: ``HP_TRAIN_KILL_AT_STEP="STEP[@RANK]"`` (rank RANK, default 0).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable
from typing import Any

from hyperpar_gdn.train.loop.callbacks import TrainCallback

__all__ = [
    "INJECT_NAN_ENV",
    "KILL_AT_STEP_ENV",
    "InjectNaN",
    "KillAtStep",
    "callbacks_from_environment",
    "injected_nan_steps",
    "kill_step",
]

INJECT_NAN_ENV = "HP_TRAIN_INJECT_NAN"
KILL_AT_STEP_ENV = "HP_TRAIN_KILL_AT_STEP"


class InjectNaN(TrainCallback):
    """The loss scale is NaN at ``steps`` (on the ranks this callback is given to)."""

    def __init__(self, steps: Iterable[int]) -> None:
        self.steps = frozenset(steps)

    def loss_scale(self, trainer: Any, step: int, scale: float) -> float:
        return float("nan") if step in self.steps else scale


class KillAtStep(TrainCallback):
    """SIGKILL to this process before step ``step``, in a run that started from step 1."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.armed = False

    def on_train_begin(self, trainer: Any) -> None:
        self.armed = trainer.step == 0  # a resumed run (the restart after the kill) goes on

    def on_step_begin(self, trainer: Any, step: int) -> None:
        if self.armed and step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def injected_nan_steps(rank: int) -> frozenset[int]:
    """The steps at which ``rank`` injects a NaN (:data:`INJECT_NAN_ENV`)."""
    text = os.environ.get(INJECT_NAN_ENV, "").strip()
    if not text:
        return frozenset()
    steps_text, _, rank_text = text.partition("@")
    try:
        steps = frozenset(int(s) for s in steps_text.split(","))
        target = int(rank_text) if rank_text else 0
    except ValueError as err:
        raise ValueError(
            f"{INJECT_NAN_ENV}={text!r} is not STEP[,STEP...][@RANK] (a test hook; unset it)"
        ) from err
    return steps if rank == target else frozenset()


def kill_step(rank: int) -> int | None:
    """The step at which ``rank`` kills itself (:data:`KILL_AT_STEP_ENV`), or None (unset, or
    another rank's)."""
    text = os.environ.get(KILL_AT_STEP_ENV, "").strip()
    if not text:
        return None
    step_text, _, rank_text = text.partition("@")
    try:
        step, target = int(step_text), int(rank_text) if rank_text else 0
    except ValueError:
        step = target = -1
    if step < 1 or target < 0:
        raise ValueError(
            f"{KILL_AT_STEP_ENV}={text!r} is not STEP[@RANK] with STEP >= 1 and RANK >= 0 "
            "(a test hook; unset it)"
        )
    return step if rank == target else None


def callbacks_from_environment(rank: int) -> list[TrainCallback]:
    """The callbacks :data:`INJECT_NAN_ENV` and :data:`KILL_AT_STEP_ENV` ask of ``rank`` (none
    when neither is set); a malformed value is a ValueError naming it."""
    callbacks: list[TrainCallback] = []
    if steps := injected_nan_steps(rank):
        callbacks.append(InjectNaN(steps))
    if (step := kill_step(rank)) is not None:
        callbacks.append(KillAtStep(step))
    return callbacks
