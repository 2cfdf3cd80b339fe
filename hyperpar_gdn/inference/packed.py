"""Packed prompts for a prefill: N prompts in one row ``[1, T]``, the way a server batches
prompts of different lengths without padding (:func:`~hyperpar_gdn.prefill_context_parallel`
with ``cu_seqlens=`` or packed ``position_ids=``).

Every prompt is read as if it were alone: its positions restart at 0, its GDN state and conv
restart at its first token, its attention sees only itself; the prefill returns its last token's
logits and a cache of its own (:mod:`hyperpar_gdn.distributed.cp.packed_states`).

Legend: N prompts, T tokens of the row.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hyperpar_gdn.ops.gdn.varlen import cu_seqlens_from_position_ids
from hyperpar_gdn.platform import Tensor, TensorOps

__all__ = ["packed_bounds", "packed_positions"]


def packed_bounds(
    xp: TensorOps, input_ids: Tensor, *, cu_seqlens: Any = None, position_ids: Tensor | None = None
) -> np.ndarray:
    """The prompts' bounds ``cu_seqlens`` (int ``[N+1]``, host) of a packed row ``input_ids``
    ``[1, T]``, from ``cu_seqlens`` or from ``position_ids`` ``[1, T]`` restarting at 0 per prompt
    (both: they must agree). A ValueError names the rule broken (the same on every rank: every rank
    passes the same row)."""
    b, t = (int(n) for n in input_ids.shape)
    if b != 1:
        raise ValueError(f"packed prompts are one row: input_ids must be [1, T]; got B={b}")
    from_positions = None
    if position_ids is not None:
        if tuple(position_ids.shape) != (1, t):
            raise ValueError(f"position_ids must be [1, T] = (1, {t}); got {tuple(position_ids.shape)}")
        positions = np.asarray(xp.to_numpy(position_ids)).reshape(-1)
        if positions[0] != 0 or ((positions[1:] != 0) & (positions[1:] != positions[:-1] + 1)).any():
            raise ValueError(
                "packed position_ids must count 0, 1, 2, ... within each prompt and restart at 0; "
                f"got {positions.tolist()}"
            )
        from_positions = np.asarray(xp.to_numpy(cu_seqlens_from_position_ids(position_ids)), dtype=np.int64)
    cu = from_positions
    if cu_seqlens is not None:
        cu = np.asarray(
            cu_seqlens if isinstance(cu_seqlens, list | tuple | np.ndarray) else xp.to_numpy(cu_seqlens)
        )
        cu = cu.astype(np.int64).reshape(-1)
        if from_positions is not None and not np.array_equal(cu, from_positions):
            raise ValueError(
                f"cu_seqlens={cu.tolist()} and the prompts of position_ids {from_positions.tolist()} differ"
            )
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != t:
        raise ValueError(f"cu_seqlens must run from 0 to T={t} over N >= 1 prompts; got {cu.tolist()}")
    empty = np.flatnonzero(np.diff(cu) <= 0).tolist()
    if empty:
        raise ValueError(
            f"the packed row holds an empty prompt: prompts {empty} of cu_seqlens={cu.tolist()} have no tokens"
        )
    return cu


def packed_positions(cu: np.ndarray) -> np.ndarray:
    """int64 ``[1, T]``: each token's position within its prompt."""
    return np.concatenate([np.arange(n) for n in np.diff(cu)]).astype(np.int64).reshape(1, -1)
