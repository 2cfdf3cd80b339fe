"""What the trainer does when a run meets a fault: a non-finite step, a save that cannot be written,
a collective that times out. No framework here: the trainer passes numbers and its backend's
reductions.

- A step whose loss or gradient norm is NaN or inf on any rank is skipped on every rank (the
  verdict rides on the reduction that sums the step's loss, so it costs no extra collective): no
  update, the gradients dropped, the step counted. :class:`BadStepGuard` stops the run after
  ``--max-bad-steps`` such steps in a row.
- A collective that times out (``--timeout-s``: a rank stopped or hung, e.g. by SIGSTOP) becomes a
  :class:`RankTimeoutError` naming the step and the ranks that did not answer a roll call held
  through the process group's store (:func:`timeout_message`).
"""

from __future__ import annotations

import math

__all__ = ["BadStepGuard", "RankTimeoutError", "SaveError", "TrainingStopped"]


class TrainingStopped(RuntimeError):
    """The run cannot go on (too many non-finite steps in a row); the message names the steps."""


class SaveError(RuntimeError):
    """A checkpoint or export could not be written; the message names the path and the cause, and
    that the checkpoints before it are intact."""


class RankTimeoutError(RuntimeError):
    """A collective waited longer than ``--timeout-s``: a rank stopped answering."""


def is_collective_timeout(err: BaseException) -> bool:
    """Whether ``err`` is a collective that waited past the process-group timeout (gloo raises
    "Timed out waiting ...", NCCL's watchdog "... timeout ...", HCCL likewise)."""
    text = str(err).lower()
    return isinstance(err, RuntimeError) and ("timed out" in text or "timeout" in text)


def timeout_message(*, step: int, rank: int, timeout_s: float, silent: list[int] | None) -> str:
    """The line a rank prints when a collective of ``step`` timed out; ``silent``: the ranks that
    did not answer the roll call (None: no roll call on this platform)."""
    if silent is None:
        who = "a rank stopped answering (this platform cannot tell which)"
    elif silent:
        who = f"rank {', '.join(map(str, silent))} did not answer (stopped, hung or gone)"
    else:
        who = "every rank answered a roll call afterwards: the collective itself hung"
    return (
        f"step {step}: a collective failed or waited more than --timeout-s {timeout_s:g} s on rank {rank}; "
        f"{who}; resume from the last checkpoint once the ranks are healthy"
    )


def is_finite(*values: float) -> bool:
    return all(math.isfinite(v) for v in values)


class BadStepGuard:
    """Counts skipped steps; raises :class:`TrainingStopped` once ``max_bad_steps`` come in a row.

    Example::

        guard = BadStepGuard(max_bad_steps=3)
        guard.record(step=7, bad_ranks=1)  # skipped, counted
        guard.record(step=8, bad_ranks=0)  # a good step resets the run of bad ones
    """

    def __init__(self, *, max_bad_steps: int) -> None:
        if max_bad_steps < 1:
            raise ValueError(f"--max-bad-steps must be >= 1; got {max_bad_steps}")
        self.max_bad_steps = max_bad_steps
        self.skipped: list[int] = []
        self.in_a_row = 0

    def record(self, *, step: int, bad_ranks: int) -> bool:
        """Step ``step`` had ``bad_ranks`` ranks with a non-finite loss or gradient norm (the same
        count on every rank); returns whether to skip it."""
        if bad_ranks == 0:
            self.in_a_row = 0
            return False
        self.skipped.append(step)
        self.in_a_row += 1
        if self.in_a_row >= self.max_bad_steps:
            first = step - self.in_a_row + 1
            raise TrainingStopped(
                f"stopped at step {step}: steps {first}..{step} ({self.in_a_row} in a row, "
                f"--max-bad-steps {self.max_bad_steps}) had a non-finite loss or gradient norm and were "
                "skipped; lower --lr, raise --warmup-steps or resume from an earlier checkpoint"
            )
        return True
