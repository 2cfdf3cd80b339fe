"""Convert a checkpoint, on one host and without a process group: to the whole format, or to a
transformers directory.

    python -m hyperpar_gdn.train.checkpoints.convert ckpt/step-40 whole-ckpt --to whole
    python -m hyperpar_gdn.train.checkpoints.convert ckpt out-model --to transformers   # a --model run's

``CKPT`` is a ``step-N`` directory or a root (its newest ``step-N``), in either format (a sharded
one in either layout: torch's DCP or MindSpore's per-rank parts); every file is checked against
the manifest first (a damaged one is the error, naming it). ``--to whole`` writes ``OUT/step-N``
in the whole format (model, optimizer, data, train, the same manifest meta), which the platform
that wrote the checkpoint resumes (the optimizer state is that platform's AdamW's). ``--to
transformers`` writes the trained weights as a transformers directory, with the config and
tokenizer of the run's ``--model`` directory (or ``--model DIR`` when that one moved), complete or
not at all; only for runs of a ``--model``. The whole state is held in this process's memory
(the sum of every rank's shard).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hyperpar_gdn.cli import Parser, UsageError, run_script
from hyperpar_gdn.train.checkpoints.whole import load_checkpoint, save_checkpoint
from hyperpar_gdn.train.checkpoints.directory import resolve_checkpoint
from hyperpar_gdn.train.errors import CheckpointError

__all__ = ["TARGETS", "convert", "main"]

TARGETS = ("whole", "transformers")


def convert(checkpoint: str | Path, out: str | Path, *, to: str, model_dir: str | None = None) -> Path:
    """Convert ``checkpoint`` (see the module docstring) and return what was written: the
    ``OUT/step-N`` directory (``to="whole"``) or the transformers directory ``out``."""
    if to not in TARGETS:
        raise ValueError(f"--to {to!r} is not one of {', '.join(TARGETS)}")
    directory = resolve_checkpoint(checkpoint)
    step, parts, meta = load_checkpoint(directory)
    if to == "whole":
        if model_dir is not None:
            raise ValueError(f"--model {model_dir} goes with --to transformers only")
        return save_checkpoint(out, step, parts, meta=meta)
    return _to_transformers(directory, parts, meta, Path(out), model_dir)


def _to_transformers(
    directory: Path, parts: dict[str, Any], meta: dict[str, Any], out: Path, model_dir: str | None
) -> Path:
    from hyperpar_gdn.integrations.transformers.model_dir import export_model_dir, load_model_dir

    trained_from = meta.get("config", {}).get("model_dir")
    source = model_dir or trained_from
    if source is None:
        raise ValueError(
            f"checkpoint {directory} is of the built-in model (no --model DIR): it has no transformers "
            "config; convert it --to whole, or pass --model DIR of a matching transformers directory"
        )
    model, tokenizer = load_model_dir(source)
    state = parts["model"]
    expected = set(model.state_dict())
    if missing := sorted(expected - set(state)):
        tied = getattr(model.config, "tie_word_embeddings", False) and missing == ["lm_head.weight"]
        if not tied:
            raise CheckpointError(
                f"checkpoint {directory} does not fit {source}: {len(missing)} weights missing, "
                f"e.g. {', '.join(missing[:3])}"
            )
    if extra := sorted(set(state) - expected):
        raise CheckpointError(
            f"checkpoint {directory} does not fit {source}: {len(extra)} unknown weights, e.g. {', '.join(extra[:3])}"
        )
    return export_model_dir(model, tokenizer, out, state_dict=state)


def build_parser() -> Parser:
    parser = Parser(prog="python -m hyperpar_gdn.train.checkpoints.convert", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a step-N checkpoint directory, or a root (its newest step-N)")
    parser.add_argument(
        "out", help="--to whole: the root to write step-N under; --to transformers: the directory"
    )
    parser.add_argument("--to", required=True, choices=TARGETS, help="the format to write")
    parser.add_argument(
        "--model",
        dest="model_dir",
        default=None,
        help="--to transformers: the transformers directory whose config and tokenizer to use "
        "(default: the run's --model)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    def body() -> int:
        args = build_parser().parse_args(argv)
        written = convert(args.checkpoint, args.out, to=args.to, model_dir=args.model_dir)
        print(f"wrote {written}", flush=True)
        return 0

    errors = (
        ValueError,
        CheckpointError,
        FileNotFoundError,
        NotADirectoryError,
        ModuleNotFoundError,
        UsageError,
    )
    return run_script("convert", body, user_errors=errors)


if __name__ == "__main__":
    sys.exit(main())
