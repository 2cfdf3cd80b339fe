"""``--check-parity``: rank 0 trains a no-CP copy on the whole global batch beside the CP run and
compares the two losses at every step; every rank learns the verdict (the exit code is 1 when a
difference exceeds ``--parity-tol``)."""

from __future__ import annotations

import math
from collections.abc import Callable

from hyperpar_gdn.train.loop.metrics import TrainResult

__all__ = ["finish_parity"]


def finish_parity(
    result: TrainResult, *, tolerance: float, is_rank_0: bool, max_over_ranks: Callable[[int], int]
) -> None:
    """Fill ``result``'s parity fields from its records (rank 0 holds the reference losses) and
    share the verdict with every rank through ``max_over_ranks`` (collective)."""
    failed = 0
    if is_rank_0:
        diffs = {
            r.step: abs(r.loss - r.reference_loss) for r in result.records if r.reference_loss is not None
        }
        result.parity_max_diff = max(diffs.values(), default=0.0)
        bad = [step for step, d in diffs.items() if not (math.isfinite(d) and d <= tolerance)]
        result.parity_first_bad_step = bad[0] if bad else None
        failed = int(bool(bad))
    result.parity_ok = not max_over_ranks(failed)
