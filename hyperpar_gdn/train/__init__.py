"""Training the hybrid LM with context (and data) parallelism; ``scripts/train.py`` is the entry point.

- :mod:`.config`: :class:`TrainConfig` (every option) and its command line.
- :mod:`.data`: byte tokens, deterministic batches, each rank's shard.
- :mod:`.checkpoint`: ``step-N/`` directories of named parts, written atomically.
- :mod:`.loop`: :class:`Trainer` (build, train, close).
"""

from hyperpar_gdn.platform.base import PlatformUnavailableError
from hyperpar_gdn.train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from hyperpar_gdn.train.config import MODEL_SIZES, TrainConfig, UsageError, parse_args
from hyperpar_gdn.train.loop import Trainer, TrainResult

# What a user can fix (an option, a file, a directory): scripts/train.py reports these in one line.
USER_ERRORS = (
    ValueError,
    FileNotFoundError,
    NotADirectoryError,
    NotImplementedError,
    ModuleNotFoundError,
    CheckpointError,
    PlatformUnavailableError,
)

__all__ = [
    "MODEL_SIZES",
    "CheckpointError",
    "TrainConfig",
    "TrainResult",
    "Trainer",
    "USER_ERRORS",
    "UsageError",
    "load_checkpoint",
    "parse_args",
    "save_checkpoint",
]
