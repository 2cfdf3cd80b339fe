"""Deprecated name of :mod:`hyperpar_gdn.train.rank_batches`
(renamed to say what it holds: a global batch cut into this rank's part)."""

from __future__ import annotations

import warnings

from hyperpar_gdn.train.rank_batches import *  # noqa: F403
from hyperpar_gdn.train.rank_batches import __all__  # noqa: F401

warnings.warn(
    "hyperpar_gdn.train.batches is now hyperpar_gdn.train.rank_batches", DeprecationWarning, stacklevel=2
)
