"""Training the hybrid LM with context (and data) parallelism; ``scripts/train.py`` is the entry point.

- :mod:`.config`: :class:`TrainConfig` (every option: its flag, type, default and help).
- :mod:`.global_batches`: tokens (bytes or a tokenizer's) and the deterministic global batches of
  a run.
- :mod:`.rank_batches`: a global batch cut into this rank's part (``shard_for_context_parallel``);
  :mod:`.data` and :mod:`.batches`: their deprecated names.
- :mod:`.loop`: :class:`Trainer` (build, train, close), written once for every framework.
- :mod:`.backend`: what a framework provides (:class:`TrainBackend`); :mod:`.torch_backend`
  and :mod:`.mindspore_loop` implement it (MindSpore's AdamW in :mod:`.mindspore_adamw`).
- :mod:`.optim` (AdamW settings, warm-up), :mod:`.resume` (``--resume`` and auto resume),
  :mod:`.metrics` (records, log lines, ``--metrics-json``), :mod:`.parity` (``--check-parity``).
- :mod:`.model_sizes`: the built-in model's ``--model-size`` presets.
- :mod:`.faults`: non-finite steps skipped, save errors, a rank that stopped answering.
- :mod:`.callbacks`: hooks into the loop (:class:`~.callbacks.TrainCallback`); the tests' fault
  injection (a NaN, a SIGKILL) is :mod:`.fault_injection`'s callbacks.
- :mod:`.checkpoint_dir`: a checkpoint's directory on disk (the manifest, checksums, the commit
  by rename, listing and pruning; no torch); :mod:`.checkpoint`: the whole format (named parts
  written by one rank) and the reading of both formats; :mod:`.sharded_checkpoint`: the sharded
  format (every rank its shard: torch's DCP, or :mod:`.replicated_shards` on MindSpore, safetensors
  files); :mod:`.saves`: the trainer's saves in either format; :mod:`.convert`: a checkpoint to the
  whole format or a transformers directory, on one host.
- :mod:`.sharding`: FSDP2 and activation checkpointing for torch.
- :mod:`.memory_check` (``--plan``'s table, the refusal of a run over its memory budget; the
  estimate is :mod:`hyperpar_gdn.planning.memory`'s).
- :mod:`.command_line`: ``scripts/train.py``'s parser, derived from :class:`TrainConfig`'s fields.
- :mod:`.errors`: the errors reported in one line (:data:`USER_ERRORS`, :data:`FAULTS`).

The names below load their module on first use, so that ``scripts/train.py`` parses its options
and checks the memory plan before torch is imported (a refused run never loads torch).
"""

from __future__ import annotations

from hyperpar_gdn._lazy import lazy_exports

_EXPORTS = {
    "FAULTS": "hyperpar_gdn.train.errors",
    "USER_ERRORS": "hyperpar_gdn.train.errors",
    "CheckpointError": "hyperpar_gdn.train.errors",
    "RankTimeoutError": "hyperpar_gdn.train.faults",
    "SaveError": "hyperpar_gdn.train.faults",
    "TrainingStopped": "hyperpar_gdn.train.faults",
    "PlatformUnavailableError": "hyperpar_gdn.platform.base",
    "TrainBackend": "hyperpar_gdn.train.backend",
    "TrainCallback": "hyperpar_gdn.train.callbacks",
    "load_checkpoint": "hyperpar_gdn.train.checkpoint",
    "save_checkpoint": "hyperpar_gdn.train.checkpoint",
    "UsageError": "hyperpar_gdn.train.command_line",
    "parse_args": "hyperpar_gdn.train.command_line",
    "MODEL_SIZES": "hyperpar_gdn.train.config",
    "TrainConfig": "hyperpar_gdn.train.config",
    "Trainer": "hyperpar_gdn.train.loop",
    "TrainResult": "hyperpar_gdn.train.metrics",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
