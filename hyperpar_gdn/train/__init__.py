"""Training the hybrid LM with context (and data) parallelism; ``scripts/train.py`` is the entry point.

Options, here: :mod:`.config` (:class:`TrainConfig`: every option, its flag, type, default and
help), :mod:`.command_line` (the parser derived from those fields), :mod:`.model_sizes` (the
``--model-size`` presets), :mod:`.errors` (the errors reported in one line: :data:`USER_ERRORS`,
:data:`FAULTS`). Memory: :mod:`.memory_check` (``--plan``, the budget check; the estimate is
:mod:`hyperpar_gdn.planning.memory`'s). Then four parts:

- :mod:`.loop`: the :class:`Trainer` (build, train, close), written once for every framework,
  its header, log, metrics, parity check, callbacks and faults;
- :mod:`.data`: the tokens and global batches of a run, and a rank's part of each;
- :mod:`.checkpoints`: both formats on disk, the saves, the resume, the converter;
- :mod:`.backends`: what a framework provides (:class:`TrainBackend`), for torch and MindSpore.

The names below load their module on first use, so that ``scripts/train.py`` parses its options
and checks the memory plan before torch is imported (a refused run never loads torch).
"""

from __future__ import annotations

from hyperpar_gdn._lazy import lazy_exports

_EXPORTS = {
    "FAULTS": "hyperpar_gdn.train.errors",
    "USER_ERRORS": "hyperpar_gdn.train.errors",
    "CheckpointError": "hyperpar_gdn.train.errors",
    "RankTimeoutError": "hyperpar_gdn.train.loop.faults",
    "SaveError": "hyperpar_gdn.train.loop.faults",
    "TrainingStopped": "hyperpar_gdn.train.loop.faults",
    "PlatformUnavailableError": "hyperpar_gdn.platform.base",
    "TrainBackend": "hyperpar_gdn.train.backends.base",
    "TrainCallback": "hyperpar_gdn.train.loop.callbacks",
    "load_checkpoint": "hyperpar_gdn.train.checkpoints.whole",
    "save_checkpoint": "hyperpar_gdn.train.checkpoints.whole",
    "UsageError": "hyperpar_gdn.train.command_line",
    "parse_args": "hyperpar_gdn.train.command_line",
    "MODEL_SIZES": "hyperpar_gdn.train.config",
    "TrainConfig": "hyperpar_gdn.train.config",
    "Trainer": "hyperpar_gdn.train.loop.trainer",
    "TrainResult": "hyperpar_gdn.train.loop.metrics",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
