"""Deprecated name of :mod:`hyperpar_gdn.train.global_batches`
(renamed to say what it holds: tokens and the global batches of a run)."""

from __future__ import annotations

import warnings

from hyperpar_gdn.train.global_batches import *  # noqa: F403
from hyperpar_gdn.train.global_batches import __all__  # noqa: F401

warnings.warn(
    "hyperpar_gdn.train.data is now hyperpar_gdn.train.global_batches", DeprecationWarning, stacklevel=2
)
