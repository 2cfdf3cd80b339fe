"""Deprecated name of :mod:`hyperpar_gdn.train.global_batches`
(renamed to say what it holds: tokens and the global batches of a run)."""

from __future__ import annotations

import warnings

from hyperpar_gdn.train.global_batches import (
    TEXT_SUFFIXES,
    VOCAB_SIZE,
    Batch,
    BatchSampler,
    TokenStream,
    VocabularyError,
    check_vocabulary,
    load_stream,
    load_tokens,
    read_documents,
)

__all__ = [
    "TEXT_SUFFIXES",
    "VOCAB_SIZE",
    "Batch",
    "BatchSampler",
    "TokenStream",
    "VocabularyError",
    "check_vocabulary",
    "load_stream",
    "load_tokens",
    "read_documents",
]

warnings.warn(
    "hyperpar_gdn.train.data is now hyperpar_gdn.train.global_batches", DeprecationWarning, stacklevel=2
)
