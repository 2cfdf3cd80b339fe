"""Causal softmax attention with RoPE as a ``mindspore.nn.Cell``: the MindSpore twin of
:class:`hyperpar_gdn.models.attention.CausalSelfAttention`, with its constructor, parameter names
and three stages (``project``, ``attend``, ``finish``), so ``SoftmaxAttentionContextParallel``
serves both. The maths is ``hyperpar_gdn.ops.attention.softmax``'s; RoPE angles are numpy constants.

Legend: B batch, T tokens (Tq queries, Tk keys), H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

from typing import Any

import mindspore as ms
import numpy as np
from mindspore import nn

from hyperpar_gdn.models.mindspore.norm import RMSNorm
from hyperpar_gdn.models.shells import AttentionShell
from hyperpar_gdn.ops.attention.softmax import (
    finish_attention,
    project_attention,
    rope_cos_sin,
    self_attention,
)
from hyperpar_gdn.ops.head_shard import head_shard_of
from hyperpar_gdn.ops.prefill_states import PrefillStates
from hyperpar_gdn.platform import ops_for

__all__ = ["CausalSelfAttention"]


class CausalSelfAttention(AttentionShell, nn.Cell):
    """Qwen3.5's full-attention layer for MindSpore: constructor and arguments in
    :class:`~hyperpar_gdn.models.shells.AttentionShell`, as the torch module's.

    Example:
        >>> attn = CausalSelfAttention(32, num_heads=4, num_kv_heads=2, head_dim=8)
        >>> tuple(attn(ms.ops.randn(2, 10, 32)).shape)
        (2, 10, 32)
    """

    def _linear(self, in_features: int, out_features: int) -> nn.Cell:
        return nn.Dense(in_features, out_features, has_bias=False)

    def _rms_norm(self, dim: int, eps: float, zero_centred: bool) -> nn.Cell:
        return RMSNorm(dim, eps=eps, zero_centred=zero_centred)

    def project(
        self, x_BTC: ms.Tensor, *, position_offset: int = 0
    ) -> tuple[ms.Tensor, ms.Tensor, ms.Tensor, ms.Tensor]:
        """x ``[B, T, hidden]`` whose token t sits at position ``position_offset + t`` ->
        q ``[B, H, T, D]``, k and v ``[B, Hkv, T, D]`` (q and k normed and rotated by RoPE),
        gate ``[B, T, H*D]``."""
        xp = ops_for(x_BTC)
        q_w, k_w, v_w, _ = self.projection_weights()
        positions_T = np.arange(x_BTC.shape[1]) + position_offset
        cos, sin = (
            ms.Tensor(a).astype(x_BTC.dtype)
            for a in rope_cos_sin(positions_T, self.rotary_dim, self.rope_theta)
        )
        return project_attention(
            xp,
            x_BTC,
            head_dim=self.head_dim,
            q_proj=lambda x: xp.linear(x, q_w),
            k_proj=lambda x: xp.linear(x, k_w),
            v_proj=lambda x: xp.linear(x, v_w),
            q_norm=self.q_norm,
            k_norm=self.k_norm,
            cos=cos,
            sin=sin,
        )

    def finish(self, o_BTX: ms.Tensor, gate_BTX: ms.Tensor) -> ms.Tensor:
        """Sigmoid output gate, then ``o_proj``: ``[B, T, H*D]`` -> ``[B, T, hidden]``."""
        xp = ops_for(o_BTX)
        o_w = self.projection_weights()[3]
        return finish_attention(xp, o_BTX, gate_BTX, lambda x: xp.linear(x, o_w))

    def projection_weights(self) -> tuple[ms.Tensor, ms.Tensor, ms.Tensor, ms.Tensor]:
        """The weights of ``q_proj``, ``k_proj``, ``v_proj`` and ``o_proj`` as the forward uses them;
        under tensor parallelism this rank's (:attr:`~hyperpar_gdn.ops.head_shard.HeadShard.weights`)."""
        shard = head_shard_of(self)
        if shard is not None and shard.weights is not None:
            return shard.weights()
        return self.q_proj.weight, self.k_proj.weight, self.v_proj.weight, self.o_proj.weight

    def construct(
        self, hidden_states: ms.Tensor, cu_seqlens: Any = None, prefill_states: PrefillStates | None = None
    ) -> ms.Tensor:
        """``cu_seqlens`` (int ``[N+1]``, B = 1): packed documents, each attending only to itself;
        ``prefill_states``: an inference prefill's record, handed K and V ``[B, Hkv, T, D]``."""
        shape = tuple(hidden_states.shape)
        if len(shape) != 3 or shape[-1] != self.hidden_size:
            raise ValueError(f"hidden_states must be [B, T, hidden_size={self.hidden_size}]; got {shape}")
        q, k, v, gate = self.project(hidden_states)
        if prefill_states is not None:
            prefill_states.keep_kv(self, k, v)
        return self.finish(self_attention(ops_for(q), q, k, v, cu_seqlens=cu_seqlens), gate)
