"""The errors a training run reports in one line, importable without a framework: ``scripts/train.py``
catches them before torch is imported (its memory check runs first, see :mod:`.memory_check`).

- :data:`USER_ERRORS`: what a user can fix (an option, a file, a directory, the platform);
  ``scripts/train.py`` reports them on rank 0 with exit code 2.
- :data:`FAULTS`: what stopped a run (:mod:`.loop.faults`); every rank reports them, exit code 3.
"""

from __future__ import annotations

from hyperpar_gdn.platform.base import PlatformUnavailableError
from hyperpar_gdn.train.loop.faults import RankTimeoutError, SaveError, TrainingStopped

__all__ = ["FAULTS", "USER_ERRORS", "CheckpointError", "VocabularyError"]


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt; the message names the path."""


class VocabularyError(ValueError):
    """Token ids the model has no embedding for (a tokenizer that does not match the model);
    raised on every rank before the first step."""


USER_ERRORS = (
    ValueError,
    FileNotFoundError,
    NotADirectoryError,
    NotImplementedError,
    ModuleNotFoundError,
    CheckpointError,
    PlatformUnavailableError,
)

FAULTS = (TrainingStopped, SaveError, RankTimeoutError)
