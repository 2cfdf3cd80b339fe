"""The command line of ``scripts/train.py``: one ``add()`` per option of :class:`TrainConfig`, in
the order ``--help`` lists them, and :func:`parse_args`."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from hyperpar_gdn.distributed.layout import LAYOUTS
from hyperpar_gdn.train.config import CHECKPOINT_FORMATS, CP_MODES, DTYPES, SAVE_ERROR_POLICIES, TrainConfig
from hyperpar_gdn.train.model_sizes import MODEL_SIZES

__all__ = ["UsageError", "build_parser", "parse_args"]


class UsageError(ValueError):
    """A command-line error (unknown option, bad value): the caller reports it."""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, unless its help already says it (a flag's own wording, or a
    None that means something)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if "default" in help_text or action.default is None:
            return help_text
        return super()._get_help_string(action) or help_text


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see --help)")


# Long on purpose: one add() per command-line option, in the order --help lists them.
def build_parser() -> argparse.ArgumentParser:
    defaults = TrainConfig()
    parser = _Parser(
        description="Train the hybrid GDN/softmax LM with context parallelism "
        "(launch with torchrun, HP_PLATFORM=cpu|cuda|npu picks the platform; or with msrun under "
        "HP_PLATFORM=mindspore).",
        formatter_class=_HelpFormatter,
    )
    add = parser.add_argument
    add(
        "--cp-mode",
        choices=CP_MODES,
        default=defaults.cp_mode,
        help="CP mode of the GDN layers (auto: the cost model's choice, see docs/modes.md)",
    )
    add(
        "--cp-layout",
        choices=LAYOUTS,
        default=None,
        help="tokens per CP rank: contiguous, or head_tail (pieces r and 2cp-1-r of 2cp; "
        "default: head_tail when the model has softmax-attention layers, else contiguous)",
    )
    add(
        "--cp-size",
        type=int,
        default=None,
        help="ranks per CP group (default: all ranks); the other ranks do data parallelism",
    )
    add(
        "--cp-inner-size",
        type=int,
        default=None,
        help="two-level --cp-mode ulysses+<state mode>: ranks per inner (ulysses) group, e.g. a node "
        "(default: none, one level)",
    )
    add("--steps", type=int, default=defaults.steps, help="optimizer steps to reach")
    add("--seq-len", type=int, default=defaults.seq_len, help="tokens per sequence, before the CP split")
    add("--batch-size", type=int, default=defaults.batch_size, help="sequences per step, all DP replicas")
    add(
        "--model-size",
        choices=list(MODEL_SIZES),
        default=None,
        help="built-in model preset (default: tiny; not with --model)",
    )
    add(
        "--model",
        dest="model_dir",
        default=None,
        help="a transformers Qwen3.5 model directory to train (default: the built-in model)",
    )
    add(
        "--export",
        default=None,
        help="with --model: write the trained model as a transformers directory (default: none)",
    )
    add("--lr", type=float, default=defaults.lr, help="peak AdamW learning rate")
    add("--warmup-steps", type=int, default=defaults.warmup_steps, help="linear warmup steps")
    add("--weight-decay", type=float, default=defaults.weight_decay, help="AdamW weight decay (matrices)")
    add("--grad-clip", type=float, default=defaults.grad_clip, help="max global grad norm (0: off)")
    add("--seed", type=int, default=defaults.seed, help="model init and data order")
    add(
        "--data",
        default=None,
        help='text file, JSONL file ("text" per line) or a directory of them (default: the built-in corpus)',
    )
    add(
        "--no-doc-boundaries",
        dest="doc_boundaries",
        action="store_false",
        help="train on plain windows of the concatenated documents (no restart at document starts; "
        "default: off, documents restart)",
    )
    add(
        "--metrics-json",
        default=None,
        help="JSON file for per-step losses, tokens/s, peak memory (rank 0; default: none)",
    )
    add("--save", default=None, help="checkpoint root directory (step-N/ under it; default: no checkpoints)")
    add("--save-every", type=int, default=defaults.save_every, help="save every N steps (0: at the end)")
    add("--keep-last", type=int, default=defaults.keep_last, help="keep the newest N checkpoints (0: all)")
    add(
        "--no-auto-resume",
        dest="auto_resume",
        action="store_false",
        help="start at step 1 even when --save DIR holds checkpoints (by default: resume from the newest)",
    )
    add(
        "--resume",
        default=None,
        help="a step-N checkpoint directory, or a root (its latest step-N; default: none)",
    )
    add(
        "--checkpoint-format",
        choices=CHECKPOINT_FORMATS,
        default=None,
        help="sharded: every rank writes its shard (torch's DCP; on MindSpore a part of its replicated "
        "state); whole: rank 0 writes the gathered state (default: sharded; both formats resume)",
    )
    add(
        "--async-save",
        action="store_true",
        help="write sharded checkpoints in the background while training goes on (default: off)",
    )
    add("--fsdp", action="store_true", help="shard parameters, gradients, optimizer state (FSDP2)")
    add("--ac", action="store_true", help="activation checkpointing per decoder layer")
    add(
        "--dtype",
        choices=DTYPES,
        default=defaults.dtype,
        help="compute dtype: bf16 (GPU/NPU) multiplies in bf16 with fp32 master weights and optimizer state",
    )
    add("--check-parity", action="store_true", help="compare every step's loss with a no-CP run on rank 0")
    add(
        "--parity-tol", type=float, default=defaults.parity_tol, help="max loss difference for --check-parity"
    )
    add("--log-every", type=int, default=defaults.log_every, help="print a step line every N steps")
    add("--timeout-s", type=float, default=defaults.timeout_s, help="process-group timeout (seconds)")
    add(
        "--max-bad-steps",
        type=int,
        default=defaults.max_bad_steps,
        help="stop after N non-finite steps in a row",
    )
    add(
        "--on-save-error",
        choices=SAVE_ERROR_POLICIES,
        default=defaults.on_save_error,
        help="a checkpoint or export that cannot be written: stop the run, or continue without it",
    )
    add(
        "--plan",
        action="store_true",
        help="print the memory plan (estimate per rank, budget, longest --seq-len that fits) and exit",
    )
    add(
        "--max-memory-gb",
        type=float,
        default=None,
        help="memory per rank in GiB; a run estimated above it is refused (default: the device's memory, "
        "on the CPU the host's available memory over the local ranks)",
    )
    return parser


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    """The command line -> :class:`TrainConfig`; raises :class:`UsageError` (an unknown option, a
    value of the wrong type) or ValueError (a bad value or combination), naming the option."""
    return TrainConfig(**vars(build_parser().parse_args(argv)))
