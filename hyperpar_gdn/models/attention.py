"""Causal softmax attention with RoPE, as in the full-attention layers of Qwen3.5.

Written for one device, as three stages that a context-parallel style can reuse with global
positions (see ``hyperpar_gdn.distributed.softmax_attention_style``); the maths of each is in
``hyperpar_gdn.ops.attention.softmax``:

1. :meth:`CausalSelfAttention.project`: q (with its output gate), k, v, per-head RMSNorm on q and
   k, RoPE at positions ``position_offset + t``.
2. :meth:`CausalSelfAttention.attend`: causal softmax attention of queries that sit at global
   positions ``q_offset + i`` over keys at positions ``0 .. Tk-1``.
3. :meth:`CausalSelfAttention.finish`: the sigmoid output gate and ``o_proj``.

Legend: B batch, T tokens (Tq queries, Tk keys), H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from hyperpar_gdn.models.norm import RMSNorm
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

_TORCH = ops_for(torch.empty(0))


class CausalSelfAttention(nn.Module):
    """Causal multi-head softmax attention with grouped KV heads, q/k RMSNorm, RoPE and a sigmoid
    output gate (Qwen3.5's full-attention layer, without a KV cache).

    Args:
        hidden_size: model width.
        num_heads: query heads H.
        num_kv_heads: key/value heads Hkv (H must be a multiple).
        head_dim: per-head dim D (even, for RoPE).
        rope_theta: RoPE base.
        norm_eps: epsilon of the q/k RMSNorms.
        rotary_dim: the leading dims of each head that RoPE rotates (None: all D; Qwen3.5 rotates
            ``partial_rotary_factor * D``).
        zero_centred_norms: q/k norms are Qwen3.5's ``x / rms(x) * (1 + weight)``.

    forward(hidden_states ``[B, T, hidden]``) -> ``[B, T, hidden]``; token t sits at position t.

    Example:
        >>> attn = CausalSelfAttention(32, num_heads=4, num_kv_heads=2, head_dim=8)
        >>> tuple(attn(torch.randn(2, 10, 32)).shape)
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
        self.q_proj = nn.Linear(hidden_size, 2 * num_heads * head_dim, bias=False)  # query and gate
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.q_norm = RMSNorm(head_dim, eps=norm_eps, zero_centred=zero_centred_norms)
        self.k_norm = RMSNorm(head_dim, eps=norm_eps, zero_centred=zero_centred_norms)

    def project(
        self, x_BTC: torch.Tensor, *, position_offset: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x ``[B, T, hidden]`` whose token t sits at position ``position_offset + t`` ->
        q ``[B, H, T, D]``, k and v ``[B, Hkv, T, D]`` (q and k normed and rotated by RoPE),
        gate ``[B, T, H*D]``."""
        positions_T = np.arange(x_BTC.shape[1]) + position_offset
        cos, sin = (
            torch.from_numpy(a).to(device=x_BTC.device, dtype=x_BTC.dtype)
            for a in rope_cos_sin(positions_T, self.rotary_dim, self.rope_theta)
        )
        return project_attention(
            _TORCH,
            x_BTC,
            head_dim=self.head_dim,
            q_proj=self.q_proj,
            k_proj=self.k_proj,
            v_proj=self.v_proj,
            q_norm=self.q_norm,
            k_norm=self.k_norm,
            cos=cos,
            sin=sin,
        )

    def attend(
        self, q_BHTD: torch.Tensor, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor, *, q_offset: int
    ) -> torch.Tensor:
        """Causal attention -> ``[B, Tq, H*D]``: query i sits at global position ``q_offset + i``
        and sees keys ``j <= q_offset + i`` (keys are positions ``0 .. Tk-1``)."""
        return causal_attention(_TORCH, q_BHTD, k_BHTD, v_BHTD, q_offset=q_offset)

    def finish(self, o_BTX: torch.Tensor, gate_BTX: torch.Tensor) -> torch.Tensor:
        """Sigmoid output gate, then ``o_proj``: ``[B, T, H*D]`` -> ``[B, T, hidden]``."""
        return finish_attention(_TORCH, o_BTX, gate_BTX, self.o_proj)

    def forward(
        self,
        hidden_states: torch.Tensor,
        *,
        cu_seqlens: torch.Tensor | None = None,
        prefill_states: PrefillStates | None = None,
    ) -> torch.Tensor:
        """hidden_states ``[B, T, hidden]`` -> ``[B, T, hidden]``; ``cu_seqlens`` (int ``[N+1]``,
        B = 1): packed documents, each attending only to itself; ``prefill_states``: an inference
        prefill's record, handed K and V ``[B, Hkv, T, D]``."""
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(
                f"hidden_states must be [B, T, hidden_size={self.hidden_size}]; "
                f"got {tuple(hidden_states.shape)}"
            )
        q, k, v, gate = self.project(hidden_states)
        if prefill_states is not None:
            prefill_states.keep_kv(self, k, v)
        return self.finish(self_attention(_TORCH, q, k, v, cu_seqlens=cu_seqlens), gate)
