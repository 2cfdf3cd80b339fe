"""What a caller hooks into :meth:`~hyperpar_gdn.train.loop.trainer.Trainer.train` without changing the
loop: :class:`TrainCallback`, given to the trainer as ``Trainer(config, callbacks=[...])``."""

from __future__ import annotations

from typing import Any

__all__ = ["TrainCallback"]


class TrainCallback:
    """Hooks the trainer calls on every rank, in the order the callbacks were given; each one here
    does nothing: override those you need. ``trainer`` is the calling
    :class:`~hyperpar_gdn.train.loop.trainer.Trainer` (``trainer.rank``, ``trainer.step``, ``trainer.config``).

    Example::

        class PrintSteps(TrainCallback):
            def on_step_begin(self, trainer: Any, step: int) -> None:
                print(f"rank {trainer.rank}: step {step}")

        Trainer(config, callbacks=[PrintSteps()]).train()
    """

    def on_train_begin(self, trainer: Any) -> None:
        """Before the first step of :meth:`~hyperpar_gdn.train.loop.trainer.Trainer.train`;
        ``trainer.step`` is the step the run resumed from (0: a run from step 1)."""

    def on_step_begin(self, trainer: Any, step: int) -> None:
        """Before step ``step`` (1-based) takes its batch."""

    def loss_scale(self, trainer: Any, step: int, scale: float) -> float:
        """The factor this rank's loss is multiplied by before the backward of step ``step``:
        ``scale`` is the trainer's (which makes the summed gradients those of the global batch's
        mean loss); another value changes this rank's gradients, and after the gradient sync
        every rank's."""
        return scale
