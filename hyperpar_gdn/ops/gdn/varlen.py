"""Packed documents (varlen): the descriptions of where documents start, their checks, and the
host-side masks and index maps that the chunked rule and the causal conv use.

Three descriptions of one packed row of T tokens (batch size 1):

- ``cu_seqlens`` int ``[N+1]`` (fla's): ``0 = cu[0] < cu[1] < ... < cu[N] = T``; document n is
  tokens ``[cu[n], cu[n+1])``.
- ``position_ids`` ``[1, T]`` (transformers' packed convention, as ``DataCollatorWithFlattening``
  emits): 0 at the first token of every document, then +1 per token.
- ``doc_starts`` bool ``[T]`` (the stages' and context parallel's form): True at the first token
  of a document. Unlike the other two it may be False at token 0: the tokens before the first
  True then continue a document that began before this segment (a context-parallel shard), so the
  state and the conv halo entering the segment reach them. It is split along T like any other
  per-token tensor.

Inside, all three become ``cuts``: the sorted token positions where the state restarts from zero
(the state entering the segment is dropped when 0 is a cut).

Legend: T tokens, N chunks (or documents where said), C chunk size, W conv width.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hyperpar_gdn.platform import Tensor, TensorOps, ops_for


def _host_ints(name: str, x: Any) -> np.ndarray:
    """A host int64 copy of a tensor, numpy array or sequence; ValueError unless it holds integers."""
    array = ops_for(x).to_numpy(x) if _is_tensor(x) else np.asarray(x)
    if array.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integers; got dtype {array.dtype}")
    return array.astype(np.int64)


def _is_tensor(x: Any) -> bool:
    """A torch or MindSpore tensor (rather than a numpy array or a Python sequence)."""
    try:
        ops_for(x)
    except TypeError:
        return False
    return True


def check_cu_seqlens(cu_seqlens: Any, *, seq_len: int, batch_size: int = 1) -> np.ndarray:
    """Validate fla's ``cu_seqlens`` (int ``[N+1]``) for a packed input of ``batch_size`` rows of
    ``seq_len`` tokens; returns it as a host int64 array. Raises ValueError naming the values."""
    if batch_size != 1:
        raise ValueError(f"packed documents (cu_seqlens) need batch size B=1; got B={batch_size}")
    cu = _host_ints("cu_seqlens", cu_seqlens)
    if cu.ndim != 1 or cu.shape[0] < 2:
        raise ValueError(f"cu_seqlens must be 1-D [N+1] with N >= 1 documents; got shape {tuple(cu.shape)}")
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0; got cu_seqlens[0]={int(cu[0])}")
    steps = np.diff(cu)
    if (steps <= 0).any():
        i = int(np.argmax(steps <= 0))
        raise ValueError(
            f"cu_seqlens must be strictly increasing (no empty documents); got cu_seqlens[{i}]={int(cu[i])}, "
            f"cu_seqlens[{i + 1}]={int(cu[i + 1])}"
        )
    if cu[-1] != seq_len:
        raise ValueError(
            f"cu_seqlens must end at the sequence length T={seq_len}; got cu_seqlens[-1]={int(cu[-1])}"
        )
    return cu


def check_doc_starts(doc_starts: Any, *, seq_len: int, name: str = "doc_starts") -> np.ndarray:
    """Validate a per-token ``doc_starts`` (bool ``[T]`` or ``[1, T]``, a tensor or numpy array);
    returns a host bool array ``[T]``."""
    array = ops_for(doc_starts).to_numpy(doc_starts) if _is_tensor(doc_starts) else np.asarray(doc_starts)
    shape = tuple(array.shape)
    if array.ndim == 2 and shape[0] == 1:
        array = array[0]
    if array.ndim != 1 or array.shape[0] != seq_len:
        raise ValueError(f"{name} must be [T] or [1, T] with T={seq_len}; got shape {shape}")
    if array.dtype != np.bool_:
        if array.dtype.kind not in "iub" or not np.isin(array, (0, 1)).all():
            raise ValueError(f"{name} must be booleans (or 0/1); got dtype {array.dtype}")
        array = array.astype(bool)
    return array


def doc_starts_from_cu_seqlens(cu_seqlens: Any, *, seq_len: int) -> np.ndarray:
    """bool ``[T]``, True at ``cu_seqlens[:-1]`` (validated)."""
    cu = check_cu_seqlens(cu_seqlens, seq_len=seq_len)
    starts = np.zeros(seq_len, dtype=bool)
    starts[cu[:-1]] = True
    return starts


def doc_ids_from_cu_seqlens(cu_seqlens: Any, *, seq_len: int) -> np.ndarray:
    """int64 ``[T]``: the document of every token (0 for the first document's tokens, 1 for the
    second's, ...), for document-causal attention masks."""
    return np.cumsum(doc_starts_from_cu_seqlens(cu_seqlens, seq_len=seq_len)) - 1


def _check_position_ids(position_ids: Any) -> np.ndarray:
    pos = _host_ints("position_ids", position_ids)
    shape = tuple(pos.shape)
    if pos.ndim == 2 and shape[0] == 1:
        pos = pos[0]
    if pos.ndim != 1 or pos.shape[0] == 0:
        raise ValueError(f"packed position_ids must be [1, T] (batch size 1, T >= 1); got shape {shape}")
    if pos[0] != 0:
        raise ValueError(f"packed position_ids must start at 0; got position_ids[0]={int(pos[0])}")
    ok = (pos[1:] == 0) | (pos[1:] == pos[:-1] + 1)
    if not ok.all():
        i = int(np.argmax(~ok)) + 1
        raise ValueError(
            "packed position_ids must restart at 0 for each document and count up by 1 within one; "
            f"got position_ids[{i - 1}]={int(pos[i - 1])}, position_ids[{i}]={int(pos[i])}"
        )
    return pos


def cu_seqlens_from_position_ids(position_ids: Tensor) -> Tensor:
    """fla's ``cu_seqlens`` (int ``[N+1]``, position_ids' framework, dtype and device) from transformers' packed
    ``position_ids`` ``[1, T]`` (0 at each document's first token, +1 after it).

    Raises ValueError, naming the first offending values, unless position_ids is [1, T] integers
    that start at 0 and, token by token, either restart at 0 or count up by 1.

    Example:
        >>> import torch
        >>> cu_seqlens_from_position_ids(torch.tensor([[0, 1, 2, 0, 1, 0]]))
        tensor([0, 3, 5, 6])
    """
    pos = _check_position_ids(position_ids)
    cu = np.append(np.flatnonzero(pos == 0), pos.shape[0])
    return ops_for(position_ids).constant(cu, like=position_ids)


def packed_doc_starts(
    *, batch_size: int, seq_len: int, cu_seqlens: Any = None, position_ids: Any = None
) -> np.ndarray | None:
    """The layer's packed-input keywords as ``doc_starts`` (bool ``[T]``), or None when neither is
    given. Both may be given only if they describe the same documents."""
    if cu_seqlens is None and position_ids is None:
        return None
    if batch_size != 1:
        given = "cu_seqlens" if position_ids is None else "position_ids"
        raise ValueError(f"packed documents ({given}) need batch size B=1; got B={batch_size}")
    from_cu = None if cu_seqlens is None else doc_starts_from_cu_seqlens(cu_seqlens, seq_len=seq_len)
    if position_ids is None:
        return from_cu
    pos = _check_position_ids(position_ids)
    if pos.shape[0] != seq_len:
        raise ValueError(f"position_ids must be [1, T] with T={seq_len}; got {pos.shape[0]} positions")
    from_pos = pos == 0
    if from_cu is not None and not np.array_equal(from_cu, from_pos):
        raise ValueError(
            "cu_seqlens and position_ids describe different documents: cu_seqlens starts them at "
            f"{np.flatnonzero(from_cu).tolist()}, position_ids at {np.flatnonzero(from_pos).tolist()}"
        )
    return from_pos


# --- the chunked rule's masks -----------------------------------------------------------------


@dataclass(frozen=True)
class ChunkMasks:
    """Which token pairs of a chunk see each other when cuts fall inside chunks (fp 0/1 tensors
    in the compute dtype, broadcast over heads; R = 1 for one segment, else one row per batch row).

    ``seg_tril`` ``[N, R, 1, C, C]``: j <= i and no cut in (j, i] (same document). The restarted
    cumulative gates are ``G = seg_tril @ g``; the decay matrix, the triangular system and
    q k^T keep only these pairs.
    ``first`` ``[N, R, 1, C, 1]``: no cut in [0, i], i.e. the state entering the chunk reaches i.
    ``last`` ``[N, R, 1, C, 1]``: no cut in (i, C-1], i.e. token i reaches the state leaving it.
    """

    seg_tril: Tensor
    first: Tensor
    last: Tensor


def chunk_mask_arrays(cuts: np.ndarray, *, num_chunks: int, chunk_size: int) -> tuple[np.ndarray, ...]:
    """The host arrays of :class:`ChunkMasks` (bool ``[N, C, C]``, ``[N, C]``, ``[N, C]``) for
    ``num_chunks`` chunks of ``chunk_size`` tokens with the state cut at ``cuts``."""
    c = chunk_size
    flags = np.zeros(num_chunks * c, dtype=np.int64)
    flags[cuts] = 1
    count = np.cumsum(flags.reshape(num_chunks, c), axis=1)  # cuts in [0, i] of each chunk
    same = count[:, :, None] == count[:, None, :]
    return same & np.tril(np.ones((c, c), dtype=bool)), count == 0, count == count[:, -1:]


def chunk_masks(
    xp: TensorOps, cuts_per_row: list[np.ndarray], *, num_chunks: int, chunk_size: int, like: Tensor
) -> ChunkMasks:
    """The masks of R rows, each with its own ``cuts``, on ``like``'s device and in its dtype:
    ``[N, R, 1, C, *]`` (built on the host as bool, one copy each, cast there)."""
    rows = [chunk_mask_arrays(cuts, num_chunks=num_chunks, chunk_size=chunk_size) for cuts in cuts_per_row]
    n, r, c = num_chunks, len(rows), chunk_size

    def const(i: int, shape: tuple[int, ...]) -> Tensor:
        return xp.constant(np.stack([row[i] for row in rows], 1).reshape(shape), like=like)

    return ChunkMasks(
        seg_tril=const(0, (n, r, 1, c, c)), first=const(1, (n, r, 1, c, 1)), last=const(2, (n, r, 1, c, 1))
    )


# --- the document-aligned layout (per-document states) -----------------------------------------


@dataclass(frozen=True)
class AlignedLayout:
    """Documents laid out so that each starts a chunk: document n is padded at its end to a
    multiple of C (padding has g = beta = 0, so it leaves the state unchanged).

    ``gather`` ``[T_pad]``: the token each padded position holds (T for padding, a zero row).
    ``scatter`` ``[T]``: the padded position of each token.
    ``entry_chunks`` ``[N-1]``: the chunk where document n >= 1 starts.
    """

    gather: np.ndarray
    scatter: np.ndarray
    entry_chunks: tuple[int, ...]


def aligned_layout(cu: np.ndarray, *, chunk_size: int) -> AlignedLayout:
    """The document-aligned layout of validated ``cu_seqlens``, computed with index arithmetic."""
    lengths = np.diff(cu)
    padded = -(-lengths // chunk_size) * chunk_size
    padded_start = np.concatenate([[0], np.cumsum(padded)[:-1]])
    seq_len = int(cu[-1])
    doc = np.repeat(np.arange(lengths.shape[0]), lengths)
    scatter = padded_start[doc] + np.arange(seq_len) - cu[:-1][doc]
    gather = np.full(int(padded.sum()), seq_len, dtype=np.int64)
    gather[scatter] = np.arange(seq_len)
    return AlignedLayout(
        gather=gather,
        scatter=scatter.astype(np.int64),
        entry_chunks=tuple(int(s) // chunk_size for s in padded_start[1:]),
    )


# --- the causal conv's masks ------------------------------------------------------------------


def conv_tap_masks(doc_starts: np.ndarray, *, width: int) -> np.ndarray:
    """``keep[s - 1, t]`` (bool ``[W-1, T]``) for s = 1..W-1: token t may read the token s steps
    back, i.e. no document starts in (t - s, t]. ``doc_starts`` covers the W-1 tokens before the
    segment (its halo) and then the segment's T tokens."""
    count = np.concatenate([[0], np.cumsum(doc_starts.astype(np.int64))])  # starts in [0, i)
    t = np.arange(width - 1, doc_starts.shape[0])
    return np.stack([count[t + 1] - count[t + 1 - s] == 0 for s in range(1, width)])


# --- the documents of one forward, checked once, their masks built once ------------------------


class Documents:
    """Packed documents (B = 1) of one segment, or of R segments of one length run as the rows of
    one batch (a context-parallel shard's fragments), as the stages read them: checked once, when
    made (:meth:`of`), and what the stages build from them (the conv's tap masks, the chunked
    rule's masks, fla's bounds) built on the first call and kept, the device tensors included.
    So one object serves every GDN layer of a forward: a model's per-forward context makes it
    once (:class:`~hyperpar_gdn.distributed.sequence.GlobalSequence`), and the second and later
    layers do no host work and copy nothing to the device. A stage given a raw ``doc_starts``
    makes its own.

    Attributes:
        starts: bool ``[R, T]``, True where a document starts (False at a row's token 0: the row
            continues a document that began before it).
        halo: bool ``[R, W-1]``, the same for the W-1 tokens before each row (its conv halo), or
            None (nothing before the rows: no halo is read).
    """

    def __init__(self, starts: np.ndarray, halo: np.ndarray | None = None) -> None:
        """From checked host arrays (:meth:`of` checks them): ``starts`` bool ``[T]`` or ``[R, T]``,
        ``halo`` bool ``[W-1]`` or ``[R, W-1]``."""
        self.starts = starts.reshape(1, -1) if starts.ndim == 1 else starts
        self.halo = None if halo is None else halo.reshape(self.starts.shape[0], -1)
        self._kept: dict[Any, Any] = {}

    @classmethod
    def of(
        cls, doc_starts: Any, *, seq_len: int, rows: int = 1, halo: Any = None, width: int | None = None
    ) -> Documents:
        """Check ``doc_starts`` (bool ``[T]`` or ``[1, T]``, or ``[R, T]`` for ``rows`` R > 1; a
        tensor or numpy array) and, with ``width``, ``halo`` (bool ``[W-1]``); a Documents of
        ``seq_len`` tokens is returned as it is (it carries its halo's starts)."""
        if isinstance(doc_starts, Documents):
            if halo is not None:
                raise ValueError(
                    "documents already checked carry their halo's starts; give no halo_doc_starts"
                )
            if doc_starts.seq_len != seq_len:
                raise ValueError(
                    f"doc_starts must cover T={seq_len} tokens; got documents of {doc_starts.seq_len}"
                )
            return doc_starts
        if rows > 1 and tuple(np.shape(doc_starts)) == (rows, seq_len):
            starts = np.stack([check_doc_starts(row, seq_len=seq_len) for row in doc_starts])
        else:
            starts = check_doc_starts(doc_starts, seq_len=seq_len)
        if halo is not None:
            halo = check_doc_starts(halo, seq_len=(width or 1) - 1, name="halo_doc_starts")
        return cls(starts, halo)

    @property
    def rows(self) -> int:
        return self.starts.shape[0]

    @property
    def seq_len(self) -> int:
        return self.starts.shape[1]

    def kept(self, key: Any, make: Callable[[], Any]) -> Any:
        """``make()`` the first time ``key`` is asked for, the same value after that."""
        if key not in self._kept:
            self._kept[key] = make()
        return self._kept[key]

    def row(self, i: int) -> Documents:
        """Row ``i`` as a Documents of its own (kept: its masks too are built once)."""
        halo = None if self.halo is None else self.halo[i]
        return self.kept(("row", i), lambda: Documents(self.starts[i], halo))

    def cu_seqlens(self) -> np.ndarray:
        """Host int64 ``[N+1]`` bounds of the documents of a single row (token 0 always starts one)."""
        if self.rows != 1:
            raise ValueError(f"cu_seqlens describes one row; these documents have {self.rows}")

        def make() -> np.ndarray:
            starts = np.flatnonzero(self.starts[0])
            return np.unique(np.concatenate([[0], starts, [self.seq_len]])).astype(np.int64)

        return self.kept("cu_seqlens", make)

    def conv_keep(self, xp: TensorOps, *, width: int, with_halo: bool, like: Tensor) -> Tensor:
        """The conv's tap masks of a single row on ``like``'s device, in its dtype: ``[W-1, 1, 1,
        T]``, tap s kept where no document starts in (t - s, t] (:func:`conv_tap_masks`);
        ``with_halo``: the row's halo is read (else zeros stand before the row)."""
        if self.rows != 1:
            raise ValueError(f"the conv's masks are one row's; these documents have {self.rows}")
        if with_halo and (self.halo is None or self.halo.shape[1] != width - 1):
            got = None if self.halo is None else f"{self.halo.shape[1]} of them"
            raise ValueError(
                f"a halo with doc_starts needs halo_doc_starts (bool [W-1], W-1={width - 1}) to know where "
                f"the halo's documents start; got {got}"
            )

        def make() -> Tensor:
            before = self.halo[0] if with_halo else np.zeros(width - 1, dtype=bool)
            keep = conv_tap_masks(np.concatenate([before, self.starts[0]]), width=width)
            return xp.constant(keep.reshape(width - 1, 1, 1, self.seq_len), like=like)

        return self.kept(("conv", width, with_halo, _where(like)), make)

    def chunk_masks(self, xp: TensorOps, *, chunk_size: int, like: Tensor) -> ChunkMasks | None:
        """The chunked rule's masks of every row (``[N, R, 1, C, *]``, :func:`chunk_masks`) on
        ``like``'s device, in its dtype, or None when no row holds a document start."""

        def make() -> ChunkMasks | None:
            cuts = [np.flatnonzero(row) for row in self.starts]
            if not any(len(c) for c in cuts):
                return None
            num_chunks = -(-self.seq_len // chunk_size)
            return chunk_masks(xp, cuts, num_chunks=num_chunks, chunk_size=chunk_size, like=like)

        return self.kept(("chunks", chunk_size, _where(like)), make)


def _where(like: Tensor) -> tuple[str, str]:
    """A device tensor's dtype and device, the key of what is built for it."""
    return str(like.dtype), str(getattr(like, "device", ""))
