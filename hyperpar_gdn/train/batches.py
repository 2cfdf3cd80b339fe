"""Deprecated name of :mod:`hyperpar_gdn.train.rank_batches`
(renamed to say what it holds: a global batch cut into this rank's part)."""

from __future__ import annotations

import warnings

from hyperpar_gdn.train.rank_batches import ReplicaRows, cut_batch, replica_rows

__all__ = ["ReplicaRows", "cut_batch", "replica_rows"]

warnings.warn(
    "hyperpar_gdn.train.batches is now hyperpar_gdn.train.rank_batches", DeprecationWarning, stacklevel=2
)
