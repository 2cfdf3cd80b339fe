"""Causal softmax attention with RoPE, as in the full-attention layers of Qwen3.5.

Written for one device, as three stages that a context-parallel style can reuse with global
positions (see ``hyperpar_gdn.distributed.attention_style``):

1. :meth:`CausalSelfAttention.project`: q (with its output gate), k, v, per-head RMSNorm on q and
   k, RoPE at positions ``position_offset + t``.
2. :meth:`CausalSelfAttention.attend`: causal softmax attention of queries that sit at global
   positions ``q_offset + i`` over keys at positions ``0 .. Tk-1``.
3. :meth:`CausalSelfAttention.finish`: the sigmoid output gate and ``o_proj``.

Legend: B batch, T tokens (Tq queries, Tk keys), H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import torch
from torch import nn

from hyperpar_gdn.ops.attention import apply_rotary, causal_attention
from hyperpar_gdn.ops.varlen import doc_ids_from_cu_seqlens
from hyperpar_gdn.platform import ops_for

from .norm import RMSNorm

_TORCH = ops_for(torch.empty(0))


def rope_cos_sin(
    positions_T: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[T, D]`` for integer positions ``[T]`` (computed in fp32)."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim; got head_dim={head_dim}")
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions_T.device) / head_dim
    inv_freq = 1.0 / (theta**exponent)
    freqs_TD2 = positions_T.to(torch.float32)[:, None] * inv_freq[None, :]
    emb_TD = torch.cat([freqs_TD2, freqs_TD2], dim=-1)
    return emb_TD.cos().to(dtype), emb_TD.sin().to(dtype)


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
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        if head_dim % 2:
            raise ValueError(f"head_dim={head_dim} must be even for RoPE")
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.rope_theta = rope_theta
        self.q_proj = nn.Linear(hidden_size, 2 * num_heads * head_dim, bias=False)  # query and gate
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.q_norm = RMSNorm(head_dim, eps=norm_eps)
        self.k_norm = RMSNorm(head_dim, eps=norm_eps)

    def project(
        self, x_BTC: torch.Tensor, *, position_offset: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x ``[B, T, hidden]`` whose token t sits at position ``position_offset + t`` ->
        q ``[B, H, T, D]``, k and v ``[B, Hkv, T, D]`` (q and k normed and rotated by RoPE),
        gate ``[B, T, H*D]``."""
        b, t, _ = x_BTC.shape
        positions_T = torch.arange(t, device=x_BTC.device) + position_offset
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q_gate = self.q_proj(x_BTC).view(b, t, h, 2 * d)
        q_BTHD, gate_BTHD = q_gate[..., :d], q_gate[..., d:]
        q_BHTD = self.q_norm(q_BTHD).transpose(1, 2)
        k_BHTD = self.k_norm(self.k_proj(x_BTC).view(b, t, hkv, d)).transpose(1, 2)
        v_BHTD = self.v_proj(x_BTC).view(b, t, hkv, d).transpose(1, 2)
        cos_TD, sin_TD = rope_cos_sin(positions_T, d, self.rope_theta, q_BHTD.dtype)
        q_BHTD = apply_rotary(_TORCH, q_BHTD, cos_TD, sin_TD)
        k_BHTD = apply_rotary(_TORCH, k_BHTD, cos_TD, sin_TD)
        return q_BHTD, k_BHTD, v_BHTD, gate_BTHD.reshape(b, t, h * d)

    def attend(
        self, q_BHTD: torch.Tensor, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor, *, q_offset: int
    ) -> torch.Tensor:
        """Causal attention -> ``[B, Tq, H*D]``: query i sits at global position ``q_offset + i``
        and sees keys ``j <= q_offset + i`` (keys are positions ``0 .. Tk-1``)."""
        return causal_attention(_TORCH, q_BHTD, k_BHTD, v_BHTD, q_offset=q_offset)

    def finish(self, o_BTX: torch.Tensor, gate_BTX: torch.Tensor) -> torch.Tensor:
        """Sigmoid output gate, then ``o_proj``: ``[B, T, H*D]`` -> ``[B, T, hidden]``."""
        return self.o_proj(o_BTX * torch.sigmoid(gate_BTX))

    def forward(self, hidden_states: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """hidden_states ``[B, T, hidden]`` -> ``[B, T, hidden]``; ``cu_seqlens`` (int ``[N+1]``,
        B = 1): packed documents, each attending only to itself."""
        b, t = hidden_states.shape[:2]
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(
                f"hidden_states must be [B, T, hidden_size={self.hidden_size}]; "
                f"got {tuple(hidden_states.shape)}"
            )
        if cu_seqlens is not None and b != 1:
            raise ValueError(f"packed documents (cu_seqlens) need batch size B=1; got B={b}")
        q, k, v, gate = self.project(hidden_states)
        doc_ids = None
        if cu_seqlens is not None:
            doc_ids = torch.as_tensor(doc_ids_from_cu_seqlens(cu_seqlens, seq_len=t), device=q.device)[None]
        return self.finish(causal_attention(_TORCH, q, k, v, q_offset=0, doc_ids=doc_ids), gate)
