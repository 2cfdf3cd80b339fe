"""One logger for training, with a rank prefix; ranks other than 0 print warnings only."""

from __future__ import annotations

import logging
import sys

LOGGER_NAME = "hyperpar_gdn.train"

logger = logging.getLogger(LOGGER_NAME)


def setup_logging(rank: int, *, all_ranks: bool = False) -> logging.Logger:
    """Send the training logger to stdout as ``[rank R] message`` (idempotent)."""
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"[rank {rank}] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if rank == 0 or all_ranks else logging.WARNING)
    logger.propagate = False
    return logger
