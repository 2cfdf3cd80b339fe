"""The command line of ``scripts/train.py``, derived from :class:`TrainConfig`'s fields (each
field's flag, type, default and help: :func:`hyperpar_gdn.cli.add_options`), and :func:`parse_args`."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from hyperpar_gdn.cli import Parser, UsageError, add_options
from hyperpar_gdn.train.config import TrainConfig

__all__ = ["UsageError", "build_parser", "parse_args"]


def build_parser() -> argparse.ArgumentParser:
    """``scripts/train.py``'s parser: one option per field of :class:`TrainConfig`, in its order."""
    parser = Parser(
        description="Train the hybrid GDN/softmax LM with context parallelism "
        "(launch with torchrun, HP_PLATFORM=cpu|cuda|npu picks the platform; or with msrun under "
        "HP_PLATFORM=mindspore).",
    )
    add_options(parser, TrainConfig)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> TrainConfig:
    """The command line -> :class:`TrainConfig`; raises :class:`UsageError` (an unknown option, a
    value of the wrong type) or ValueError (a bad value or combination), naming the option."""
    return TrainConfig(**vars(build_parser().parse_args(argv)))
