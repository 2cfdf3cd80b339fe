"""The torch side of the MindSpore training tests: a torch run to compare with, and torch's answer
to a checkpoint it must refuse.

Both are workers for :func:`distributed_harness.run_ranks` (``worker(rank, world, options)``, in
a forked rank with ``HP_PLATFORM`` set by the caller); ``options`` are
:class:`hyperpar_gdn.train.TrainConfig`'s fields::

    monkeypatch.setenv("HP_PLATFORM", "cpu")
    losses = run_ranks(torch_losses, 1, {"seq_len": 32, "steps": 4}, timeout_s=120)[0]
"""

from __future__ import annotations

from typing import Any

from hyperpar_gdn.train import TrainConfig, Trainer

__all__ = ["torch_losses", "torch_resume_error"]


def torch_losses(rank: int, world: int, options: dict[str, Any]) -> list[float]:
    """Trains the torch :class:`Trainer` with ``options`` and returns its per-step losses (every
    step, in order); the trainer is closed whether or not training raises."""
    trainer = Trainer(TrainConfig(**options))
    try:
        return trainer.train().losses
    finally:
        trainer.close()


def torch_resume_error(rank: int, world: int, options: dict[str, Any]) -> str:
    """The ``ValueError`` message the torch :class:`Trainer` raises while it starts with ``options``
    (a ``resume`` it must refuse), or ``"no error"`` if it starts."""
    try:
        Trainer(TrainConfig(**options)).close()
    except ValueError as err:
        return str(err)
    return "no error"
