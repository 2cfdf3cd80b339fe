"""The decoding state a prompt leaves behind, collected from the token mixers while it runs.

A decoder continues a prompt from, per layer (docs/inference.md, what each layer hands over):

- a GDN layer: its conv state, the last W pre-conv inputs of the prompt ``[B, C, W]`` (zeros
  before the first token when the prompt is shorter; transformers keeps W of them, the step reads
  the last W-1), and its recurrent state S after the last token ``[B, H, K, V]`` in the compute
  dtype (fp32, fp64 for an fp64 model);
- a softmax attention layer: K and V of every prompt token ``[B, Hkv, T, D]`` (after the k norm
  and RoPE).

The mixers' forwards (single-device and context-parallel) ask :func:`active_prefill_states` once
per call; outside :func:`record_prefill_states` it returns None and they compute nothing more.
Inside, every mixer hands its state of the whole prompt to the :class:`PrefillStates`, keyed by the
mixer module, on every rank.

Legend: B batch, T prompt tokens, C conv channels, W conv width, H value heads, K/V head dims,
Hkv key/value heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from hyperpar_gdn.platform import Tensor, TensorOps

__all__ = ["PrefillStates", "active_prefill_states", "conv_state_of", "record_prefill_states"]


@dataclass
class PrefillStates:
    """States of the mixers that ran, by mixer: ``gdn[id(module)] = (conv [B, C, W], S [B, H, K, V])``,
    ``kv[id(module)] = (K, V)`` each ``[B, Hkv, T, D]``. A mixer that runs twice is refused."""

    gdn: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)
    kv: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)

    def keep_gdn(self, module: Any, conv_BCW: Tensor, state_BHKV: Tensor) -> None:
        self._check_new(module)
        self.gdn[id(module)] = (conv_BCW, state_BHKV)

    def keep_kv(self, module: Any, k_BHTD: Tensor, v_BHTD: Tensor) -> None:
        self._check_new(module)
        self.kv[id(module)] = (k_BHTD, v_BHTD)

    def _check_new(self, module: Any) -> None:
        if id(module) in self.gdn or id(module) in self.kv:
            raise RuntimeError(
                f"{type(module).__name__} ran twice while recording prefill states: one forward of the "
                "prompt per record_prefill_states()"
            )


_ACTIVE: ContextVar[PrefillStates | None] = ContextVar("hyperpar_gdn_prefill_states", default=None)


@contextmanager
def record_prefill_states() -> Iterator[PrefillStates]:
    """Collect the decoding state of every mixer that runs inside the ``with`` block.

    Example::

        with torch.no_grad(), record_prefill_states() as states:
            model(prompt_ids)
        conv, s = states.gdn[id(model.layers[0].linear_attn)]
    """
    states = PrefillStates()
    token = _ACTIVE.set(states)
    try:
        yield states
    finally:
        _ACTIVE.reset(token)


def active_prefill_states() -> PrefillStates | None:
    """The :class:`PrefillStates` being recorded, or None (a training or plain forward)."""
    return _ACTIVE.get()


def conv_state_of(xp: TensorOps, tail_BTC: Tensor, width: int) -> Tensor:
    """The conv state ``[B, C, W]`` from the last pre-conv inputs of a prompt ``[B, T', C]``
    (``T' <= W`` of them or more): the last W, zeros in front when fewer."""
    t = tail_BTC.shape[1]
    if t >= width:
        tail_BTC = tail_BTC[:, t - width :]
    else:
        tail_BTC = xp.pad_dim(tail_BTC, 1, width - t, 0)
    return xp.swapaxes(tail_BTC, 1, 2)
