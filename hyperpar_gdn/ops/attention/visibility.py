"""Which queries see which keys: the token description that causal softmax attention takes, and
the two host-side maps that its fast paths walk (numpy only, no framework).

Queries and keys are described by where they sit in the whole sequence, not by an offset:

- :class:`Tokens`: the global position of every token (int ``[T]``, any order, e.g. two fragments
  of a load-balanced layout or an all-gathered sequence) and, for packed documents, its document
  id. Query q sees key k when ``pos[k] <= pos[q]``, both are in the same document, and the key is
  not padding (``key_mask`` ``[B, Tk]``, 1 = token, 0 = padding).
- :class:`BlockMap`: query blocks x key blocks of a fixed size, each block pair ``NONE`` (no
  query of the block may see any of its keys: skipped), ``FULL`` (every query sees every key: no
  mask) or ``PARTIAL`` (a block-sized mask, built only for those pairs). The generic blockwise
  attention walks it.
- :class:`Segments`: the visible pairs as rectangles that are either fully visible or a causal
  square (query i sees keys 0..i of the square), with no mask at all; what fused kernels that
  return their log-sum-exp (``is_causal`` or nothing) need. Exists only when the padding is the
  same in every batch row.

Legend: B batch, Tq queries, Tk keys, nq / nk query / key blocks, bq / bk block sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

NONE, FULL, PARTIAL = 0, 1, 2


@dataclass(frozen=True)
class Tokens:
    """Where tokens sit: ``positions`` int ``[T]`` (global positions; distinct), ``docs`` int
    ``[T]`` (document of each token; packed documents) or None (one document).

    Example (a rank holding two fragments of a 16-token sequence, and all keys)::

        queries = Tokens.cat([Tokens.span(0, 4), Tokens.span(12, 16)])
        keys = Tokens.span(0, 16)
    """

    positions: np.ndarray
    docs: np.ndarray | None = None

    def __post_init__(self) -> None:
        pos = np.asarray(self.positions)
        if pos.ndim != 1 or pos.dtype.kind not in "iu":
            raise ValueError(
                f"Tokens.positions must be a 1-D int array; got shape {pos.shape}, dtype {pos.dtype}"
            )
        object.__setattr__(self, "positions", pos.astype(np.int64))
        if self.docs is not None:
            docs = np.asarray(self.docs)
            if docs.shape != pos.shape or docs.dtype.kind not in "iu":
                raise ValueError(
                    f"Tokens.docs must be int [T={pos.shape[0]}] like the positions; "
                    f"got shape {docs.shape}, dtype {docs.dtype}"
                )
            object.__setattr__(self, "docs", docs.astype(np.int64))

    def __len__(self) -> int:
        return int(self.positions.shape[0])

    @staticmethod
    def span(start: int, stop: int, docs: Any = None) -> Tokens:
        """Tokens at positions ``start .. stop-1``; ``docs`` int ``[stop - start]`` or None."""
        return Tokens(np.arange(start, stop, dtype=np.int64), None if docs is None else np.asarray(docs))

    @staticmethod
    def cat(parts: list[Tokens]) -> Tokens:
        """The tokens of ``parts`` one after the other (all with docs or none)."""
        with_docs = {p.docs is not None for p in parts}
        if len(with_docs) != 1:
            raise ValueError("Tokens.cat: either every part has docs or none has")
        docs = np.concatenate([p.docs for p in parts]) if with_docs == {True} else None
        return Tokens(np.concatenate([p.positions for p in parts]), docs)

    def doc_array(self) -> np.ndarray:
        """``docs``, or zeros (one document)."""
        return np.zeros(len(self), np.int64) if self.docs is None else self.docs

    def runs(self, keep: np.ndarray | None = None) -> list[tuple[int, int, int]]:
        """``(index, position, length)`` of every maximal run of tokens at consecutive positions in
        one document; ``keep`` bool ``[T]``: tokens left out (padding) end a run and join none."""
        n = len(self)
        if n == 0:
            return []
        pos, docs = self.positions, self.doc_array()
        keep = np.ones(n, bool) if keep is None else keep
        breaks = np.ones(n, bool)
        breaks[1:] = (pos[1:] != pos[:-1] + 1) | (docs[1:] != docs[:-1]) | ~keep[:-1]
        stops = np.ones(n, bool)  # the run of token i ends after it
        stops[:-1] = breaks[1:] | ~keep[1:]
        starts, ends = np.flatnonzero(breaks & keep), np.flatnonzero(stops & keep) + 1
        return [(int(s), int(pos[s]), int(e - s)) for s, e in zip(starts, ends, strict=True)]


def check_tokens(queries: Tokens, keys: Tokens, *, tq: int, tk: int) -> None:
    """ValueError unless the descriptions match the tensors' lengths and both or neither have docs."""
    if len(queries) != tq or len(keys) != tk:
        raise ValueError(
            f"queries describe {len(queries)} tokens and keys {len(keys)}, but the tensors hold Tq={tq} "
            f"queries and Tk={tk} keys"
        )
    if (queries.docs is None) != (keys.docs is None):
        raise ValueError("packed documents need docs on both the queries and the keys (or on neither)")


def visible_pairs(queries: Tokens, keys: Tokens, key_mask: np.ndarray | None) -> np.ndarray:
    """bool ``[B or 1, Tq, Tk]``: query i sees key j (dense; for block-sized pieces and tests)."""
    vis = keys.positions[None, :] <= queries.positions[:, None]
    if queries.docs is not None:
        vis &= keys.docs[None, :] == queries.docs[:, None]
    vis = vis[None]
    if key_mask is not None:
        vis = vis & (key_mask != 0)[:, None, :]
    return vis


@dataclass(frozen=True)
class BlockMap:
    """Query blocks of ``block_q`` rows x key blocks of ``block_k`` keys.

    ``kind`` int ``[nq, nk]``: NONE, FULL or PARTIAL; :meth:`mask` gives a PARTIAL pair's bool
    ``[B or 1, bq, bk]`` mask (built on demand, block-sized)."""

    queries: Tokens
    keys: Tokens
    key_mask: np.ndarray | None
    block_q: int
    block_k: int
    kind: np.ndarray

    def q_sizes(self) -> list[int]:
        return _sizes(len(self.queries), self.block_q)

    def k_sizes(self) -> list[int]:
        return _sizes(len(self.keys), self.block_k)

    def mask(self, i: int, j: int) -> np.ndarray:
        qs, ks = (
            slice(i * self.block_q, (i + 1) * self.block_q),
            slice(j * self.block_k, (j + 1) * self.block_k),
        )
        q = Tokens(self.queries.positions[qs], None if self.queries.docs is None else self.queries.docs[qs])
        k = Tokens(self.keys.positions[ks], None if self.keys.docs is None else self.keys.docs[ks])
        return visible_pairs(q, k, None if self.key_mask is None else self.key_mask[:, ks])


def _sizes(n: int, block: int) -> list[int]:
    return [min(block, n - s) for s in range(0, n, block)]


def _block_reduce(x: np.ndarray, block: int, fn: Any) -> np.ndarray:
    """``fn`` over consecutive blocks of the last axis of ``x`` (the last block may be short)."""
    return np.stack([fn(x[..., s : s + block], axis=-1) for s in range(0, x.shape[-1], block)], -1)


def block_map(
    queries: Tokens, keys: Tokens, key_mask: np.ndarray | None, *, block_q: int, block_k: int
) -> BlockMap:
    """Classify every (query block, key block) pair from per-block bounds (exact for FULL and
    NONE; a PARTIAL pair may still hide every key, its mask then says so)."""
    qp, kp = queries.positions, keys.positions
    q_min, q_max = _block_reduce(qp, block_q, np.min), _block_reduce(qp, block_q, np.max)
    k_min, k_max = _block_reduce(kp, block_k, np.min), _block_reduce(kp, block_k, np.max)
    none = k_min[None, :] > q_max[:, None]
    full = k_max[None, :] <= q_min[:, None]
    if queries.docs is not None:
        qd, kd = queries.docs, keys.docs
        qd_min, qd_max = _block_reduce(qd, block_q, np.min), _block_reduce(qd, block_q, np.max)
        kd_min, kd_max = _block_reduce(kd, block_k, np.min), _block_reduce(kd, block_k, np.max)
        none |= (kd_min[None, :] > qd_max[:, None]) | (kd_max[None, :] < qd_min[:, None])
        full &= (
            (qd_min == qd_max)[:, None] & (kd_min == kd_max)[None, :] & (qd_min[:, None] == kd_min[None, :])
        )
    if key_mask is not None:
        valid = key_mask != 0
        none |= ~_block_reduce(valid.any(0), block_k, np.any)[None, :]
        full &= _block_reduce(valid.all(0), block_k, np.all)[None, :]
    kind = np.where(none, NONE, np.where(full, FULL, PARTIAL)).astype(np.int8)
    return BlockMap(queries, keys, key_mask, block_q, block_k, kind)


@dataclass(frozen=True)
class Segment:
    """Queries ``[q0, q1)`` x keys ``[k0, k1)`` (tensor indices), every pair visible, or, with
    ``causal``, a square where the i-th query sees keys ``k0 .. k0+i``."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool


@dataclass(frozen=True)
class Segments:
    """The visible (query, key) pairs as disjoint :class:`Segment` s, grouped for merging:
    ``q_runs`` and ``k_runs`` are ``(start, stop)`` index ranges; every segment lies inside one
    query run and one key run. Queries of no segment see no key; keys of no run are padding."""

    segments: tuple[Segment, ...]
    q_runs: tuple[tuple[int, int], ...]
    k_runs: tuple[tuple[int, int], ...]


def visible_segments(queries: Tokens, keys: Tokens, key_mask: np.ndarray | None) -> Segments | None:
    """Rectangles that need no mask, or None when the padding differs between batch rows.

    A query run at positions ``[p0, p1)`` and a key run at ``[c0, c1)`` of the same document give
    at most three: keys before ``p0`` (all visible to every query), the causal square over
    ``[max(c0, p0), min(c1, p1))``, and that square's keys for the queries after it."""
    keep = None
    if key_mask is not None:
        valid = key_mask != 0
        if not (valid == valid[:1]).all():
            return None
        keep = valid[0]
    q_runs, k_runs = queries.runs(), keys.runs(keep)
    q_docs, k_docs = queries.doc_array(), keys.doc_array()
    segments = []
    for qi, p0, n in q_runs:
        p1 = p0 + n
        for ki, c0, m in k_runs:
            c1 = c0 + m
            if k_docs[ki] != q_docs[qi] or c0 >= p1:
                continue
            before = min(c1, p0)
            if c0 < before:
                segments.append(Segment(qi, qi + n, ki, ki + before - c0, False))
            a, b = max(c0, p0), min(c1, p1)
            if a < b:
                ka, kb = ki + a - c0, ki + b - c0
                segments.append(Segment(qi + a - p0, qi + b - p0, ka, kb, True))
                if b < p1:
                    segments.append(Segment(qi + b - p0, qi + n, ka, kb, False))
    return Segments(
        tuple(segments),
        tuple((i, i + n) for i, _, n in q_runs),
        tuple((i, i + n) for i, _, n in k_runs),
    )
