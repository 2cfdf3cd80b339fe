"""Choosing the next tokens from logits: greedy or sampled, and the decoding loop around a step.

- :class:`Sampling`: greedy (the argmax) or a sample of ``softmax(logits / temperature)`` over
  the ``top_k`` likeliest tokens, from a seeded generator;
- :func:`decode`: ``max_new_tokens`` tokens from a prefill's last logits, one ``step`` per token.

numpy only: the logits come in as ``[B, V]`` arrays from either framework.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = ["Sampling", "decode"]


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """How the next token is chosen.

    Attributes:
        sample: sample instead of taking the argmax.
        temperature: softmax temperature of a sample, > 0.
        top_k: sample from the k likeliest tokens (0: all).
        seed: the seed of the sampling generator.
    """

    sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.temperature > 0 or self.top_k < 0:
            raise ValueError(
                f"temperature={self.temperature} must be > 0 and top_k={self.top_k} >= 0 (0: every token)"
            )

    def pick(self, logits: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """The next token per row ``[B, 1]`` from ``logits`` ``[B, V]``."""
        if not self.sample:
            return logits.argmax(-1).reshape(-1, 1)
        z = logits.astype(np.float64) / self.temperature
        if self.top_k:
            kth = np.sort(z, -1)[:, -min(self.top_k, z.shape[-1])][:, None]
            z = np.where(z >= kth, z, -np.inf)
        p = np.exp(z - z.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        return np.array([[rng.choice(p.shape[-1], p=row)] for row in p])


def decode(
    logits: np.ndarray,
    step: Callable[[np.ndarray], np.ndarray],
    *,
    max_new_tokens: int,
    sampling: Sampling,
) -> tuple[list[int], float]:
    """``max_new_tokens`` tokens after a prefill whose last logits are ``logits`` ``[B, V]``;
    ``step`` takes the chosen tokens ``[B, 1]`` and returns the next logits ``[B, V]`` (it is not
    called after the last token) -> (the tokens of row 0, the seconds taken)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be at least 1")
    rng = np.random.default_rng(sampling.seed)
    tokens, last = [], logits
    start = time.perf_counter()
    for i in range(max_new_tokens):
        token = sampling.pick(last, rng)
        tokens.append(int(token[0, 0]))
        if i + 1 < max_new_tokens:
            last = step(token)
    return tokens, time.perf_counter() - start
