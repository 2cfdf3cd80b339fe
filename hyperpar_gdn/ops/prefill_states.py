"""The decoding state a prompt leaves behind, handed explicitly to every token mixer.

A decoder continues a prompt from, per layer:

- a GDN layer: its conv state, the last W pre-conv inputs of the prompt ``[B, C, W]`` (zeros
  before the first token when the prompt is shorter; transformers keeps W of them, the step reads
  the last W-1), and its recurrent state S after the last token ``[B, H, K, V]`` in the compute
  dtype (fp32, fp64 for an fp64 model);
- a softmax attention layer: K and V of every prompt token ``[B, Hkv, T, D]`` in global order
  (after the k norm and RoPE).

How it travels: an inference prefill (:mod:`hyperpar_gdn.inference`) makes one
:class:`PrefillStates` and passes it as the keyword ``prefill_states=`` of every mixer call
(through the model's decoder layers, which forward their keywords to the mixers). A mixer given
one computes its state of the whole prompt (under context parallelism: on every rank) and hands
it over with :meth:`PrefillStates.keep_gdn` or :meth:`PrefillStates.keep_kv`; a mixer given None
(training, a plain forward) computes nothing more. There is no ambient or global state.

Legend: B batch, T prompt tokens, C conv channels, W conv width, H value heads, K/V head dims,
Hkv key/value heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hyperpar_gdn.platform import Tensor, TensorOps

__all__ = ["PrefillStates", "check_cached_tokens", "conv_state_of"]


@dataclass
class PrefillStates:
    """States of the mixers that ran, by mixer: ``gdn[id(module)] = (conv [B, C, W], S [B, H, K, V])``,
    ``kv[id(module)] = (K, V)`` each ``[B, Hkv, T, D]``. A mixer that runs twice is refused.

    Example::

        states = PrefillStates()
        with torch.no_grad():
            layer(x, prefill_states=states)         # a GDN layer of this package
        conv, s = states.gdn[id(layer)]
    """

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
                f"{type(module).__name__} ran twice with the same PrefillStates: one forward of the "
                "prompt per PrefillStates"
            )


def conv_state_of(xp: TensorOps, tail_BTC: Tensor, width: int) -> Tensor:
    """The conv state ``[B, C, W]`` from the last pre-conv inputs of a prompt ``[B, T', C]``
    (``T' <= W`` of them or more): the last W, zeros in front when fewer."""
    t = tail_BTC.shape[1]
    if t >= width:
        tail_BTC = tail_BTC[:, t - width :]
    else:
        tail_BTC = xp.pad_dim(tail_BTC, 1, width - t, 0)
    return xp.swapaxes(tail_BTC, 1, 2)


def check_cached_tokens(layer: int, held: int, length: int) -> None:
    """Refuse a cache whose attention layer ``layer`` holds ``held`` tokens after a prompt of ``length``."""
    if held != length:
        raise ValueError(f"layer {layer} of the cache holds {held} tokens, not length={length}")
