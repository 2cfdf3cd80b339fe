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
from hyperpar_gdn.models.shells import AttentionShell
from hyperpar_gdn.ops.attention.softmax import (
    finish_attention,
    project_attention,
    rope_cos_sin,
    self_attention,
)
from hyperpar_gdn.ops.prefill_states import PrefillStates
from hyperpar_gdn.platform import ops_for

_TORCH = ops_for(torch.empty(0))


class CausalSelfAttention(AttentionShell, nn.Module):
    """Qwen3.5's full-attention layer for PyTorch: constructor and arguments in
    :class:`~hyperpar_gdn.models.shells.AttentionShell`.

    Example:
        >>> attn = CausalSelfAttention(32, num_heads=4, num_kv_heads=2, head_dim=8)
        >>> tuple(attn(torch.randn(2, 10, 32)).shape)
        (2, 10, 32)
    """

    def _linear(self, in_features: int, out_features: int) -> nn.Module:
        return nn.Linear(in_features, out_features, bias=False)

    def _rms_norm(self, dim: int, eps: float, zero_centred: bool) -> nn.Module:
        return RMSNorm(dim, eps=eps, zero_centred=zero_centred)

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
