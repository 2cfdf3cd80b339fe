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
from hyperpar_gdn.ops.attention.softmax import (
    causal_attention,
    finish_attention,
    init_attention_dims,
    project_attention,
    rope_cos_sin,
    self_attention,
)
from hyperpar_gdn.ops.prefill_states import PrefillStates
from hyperpar_gdn.platform import ops_for

__all__ = ["CausalSelfAttention"]


class CausalSelfAttention(nn.Cell):
    """Causal multi-head softmax attention with grouped KV heads, q/k RMSNorm, RoPE (partial with
    ``rotary_dim``) and a sigmoid output gate; same constructor, parameter names and stages as the
    torch module (see its docstring for the arguments).

    construct(hidden_states ``[B, T, hidden]``) -> ``[B, T, hidden]``; token t sits at position t.

    Example:
        >>> attn = CausalSelfAttention(32, num_heads=4, num_kv_heads=2, head_dim=8)
        >>> tuple(attn(ms.ops.randn(2, 10, 32)).shape)
        (2, 10, 32)
    """

    def __init__(
        self,
        hidden_size: int,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rope_theta: float = 10000.0,
        norm_eps: float = 1e-6,
        rotary_dim: int | None = None,
        zero_centred_norms: bool = False,
    ) -> None:
        super().__init__()
        init_attention_dims(
            self,
            hidden_size=hidden_size,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rope_theta=rope_theta,
            rotary_dim=rotary_dim,
        )
        self.q_proj = nn.Dense(hidden_size, 2 * num_heads * head_dim, has_bias=False)  # query and gate
        self.k_proj = nn.Dense(hidden_size, num_kv_heads * head_dim, has_bias=False)
        self.v_proj = nn.Dense(hidden_size, num_kv_heads * head_dim, has_bias=False)
        self.o_proj = nn.Dense(num_heads * head_dim, hidden_size, has_bias=False)
        self.q_norm = RMSNorm(head_dim, eps=norm_eps, zero_centred=zero_centred_norms)
        self.k_norm = RMSNorm(head_dim, eps=norm_eps, zero_centred=zero_centred_norms)

    def project(
        self, x_BTC: ms.Tensor, *, position_offset: int = 0
    ) -> tuple[ms.Tensor, ms.Tensor, ms.Tensor, ms.Tensor]:
        """x ``[B, T, hidden]`` whose token t sits at position ``position_offset + t`` ->
        q ``[B, H, T, D]``, k and v ``[B, Hkv, T, D]`` (q and k normed and rotated by RoPE),
        gate ``[B, T, H*D]``."""
        xp = ops_for(x_BTC)
        positions_T = np.arange(x_BTC.shape[1]) + position_offset
        cos, sin = (
            ms.Tensor(a).astype(x_BTC.dtype)
            for a in rope_cos_sin(positions_T, self.rotary_dim, self.rope_theta)
        )
        return project_attention(
            xp,
            x_BTC,
            head_dim=self.head_dim,
            q_proj=lambda x: xp.linear(x, self.q_proj.weight),
            k_proj=lambda x: xp.linear(x, self.k_proj.weight),
            v_proj=lambda x: xp.linear(x, self.v_proj.weight),
            q_norm=self.q_norm,
            k_norm=self.k_norm,
            cos=cos,
            sin=sin,
        )

    def attend(self, q_BHTD: ms.Tensor, k_BHTD: ms.Tensor, v_BHTD: ms.Tensor, *, q_offset: int) -> ms.Tensor:
        """Causal attention -> ``[B, Tq, H*D]``: query i sits at global position ``q_offset + i``
        and sees keys ``j <= q_offset + i`` (keys are positions ``0 .. Tk-1``)."""
        return causal_attention(ops_for(q_BHTD), q_BHTD, k_BHTD, v_BHTD, q_offset=q_offset)

    def finish(self, o_BTX: ms.Tensor, gate_BTX: ms.Tensor) -> ms.Tensor:
        """Sigmoid output gate, then ``o_proj``: ``[B, T, H*D]`` -> ``[B, T, hidden]``."""
        xp = ops_for(o_BTX)
        return finish_attention(xp, o_BTX, gate_BTX, lambda x: xp.linear(x, self.o_proj.weight))

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
