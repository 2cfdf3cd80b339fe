"""Training the hybrid LM with context (and data) parallelism; ``scripts/train.py`` is the entry point.

- :mod:`.config`: :class:`TrainConfig` (every option) and its command line.
- :mod:`.data`: tokens (bytes or a tokenizer's) and deterministic global batches.
- :mod:`.batches`: a rank's part of a batch, cut by ``shard_for_context_parallel``.
- :mod:`.loop`: :class:`Trainer` (build, train, close), written once for every framework.
- :mod:`.backend`: what a framework provides (:class:`TrainBackend`); :mod:`.torch_backend`
  and :mod:`.mindspore_loop` implement it.
- :mod:`.optim` (AdamW settings, warm-up), :mod:`.resume` (``--resume`` and auto resume),
  :mod:`.metrics` (records, log lines, ``--metrics-json``), :mod:`.parity` (``--check-parity``).
- :mod:`.model_sizes`: the built-in model's ``--model-size`` presets.
- :mod:`.faults`: non-finite steps skipped, save errors, a rank that stopped answering.
- :mod:`.checkpoint`: ``step-N/`` directories of named parts, written atomically (the whole
  format), and the reading of both formats; :mod:`.sharded_checkpoint`: the sharded format
  (every rank its shard: torch's DCP, or :mod:`.replicated_shards` on MindSpore, whose files are
  :mod:`.tensor_file`'s); :mod:`.saves`: the trainer's saves in either format;
  :mod:`.convert`: a checkpoint to the whole format or a transformers directory, on one host.
- :mod:`.sharding`: FSDP2 and activation checkpointing for torch.
- :mod:`.memory_plan` (the per-rank memory estimate, framework-free) and :mod:`.memory_check`
  (``--plan``'s table, the refusal of a run over its memory budget).
- :mod:`.command_line`: ``scripts/train.py``'s options.
"""

from hyperpar_gdn.platform.base import PlatformUnavailableError
from hyperpar_gdn.train.backend import TrainBackend
from hyperpar_gdn.train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from hyperpar_gdn.train.command_line import UsageError, parse_args
from hyperpar_gdn.train.config import MODEL_SIZES, TrainConfig
from hyperpar_gdn.train.faults import RankTimeoutError, SaveError, TrainingStopped
from hyperpar_gdn.train.loop import Trainer
from hyperpar_gdn.train.metrics import TrainResult

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

# Faults that stopped a run (scripts/train.py: one line on every rank, exit code 3).
FAULTS = (TrainingStopped, SaveError, RankTimeoutError)

__all__ = [
    "FAULTS",
    "RankTimeoutError",
    "SaveError",
    "TrainingStopped",
    "MODEL_SIZES",
    "CheckpointError",
    "TrainBackend",
    "TrainConfig",
    "TrainResult",
    "Trainer",
    "USER_ERRORS",
    "UsageError",
    "load_checkpoint",
    "parse_args",
    "save_checkpoint",
]
