"""Causal softmax attention with RoPE as a ``mindspore.nn.Cell``: the MindSpore twin of
:class:`hyperpar_gdn.models.attention.CausalSelfAttention`, with its parameter names and its three
stages (``project``, ``attend``, ``finish``), so ``SoftmaxAttentionContextParallel`` serves both.

Only ops measured to work with gradients on CPU in MindSpore 2.10 (DESIGN.md section 4):
``mint.matmul``, ``mint.nn.functional.linear``, Tensor ``masked_fill``/``repeat_interleave``,
``ops.cat``, ``ops.softmax`` and the platform's TensorOps. RoPE angles are constants, computed in numpy.

Legend: B batch, T tokens (Tq queries, Tk keys), H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import mint, nn

from hyperpar_gdn.ops.attention import apply_rotary, causal_attention
from hyperpar_gdn.platform import ops_for

from .norm import RMSNorm

__all__ = ["CausalSelfAttention", "rope_cos_sin"]


def rope_cos_sin(
    positions_T: np.ndarray, head_dim: int, theta: float, dtype: ms.Type
) -> tuple[ms.Tensor, ms.Tensor]:
    """cos and sin ``[T, D]`` for integer positions ``[T]`` (computed in fp32, as torch's)."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim; got head_dim={head_dim}")
    exponent = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / (np.float32(theta) ** exponent)).astype(np.float32)
    freqs_TD2 = positions_T.astype(np.float32)[:, None] * inv_freq[None, :]
    emb_TD = np.concatenate([freqs_TD2, freqs_TD2], axis=-1)
    return ms.Tensor(np.cos(emb_TD)).astype(dtype), ms.Tensor(np.sin(emb_TD)).astype(dtype)


class CausalSelfAttention(nn.Cell):
    """Causal multi-head softmax attention with grouped KV heads, q/k RMSNorm, RoPE and a sigmoid
    output gate; same constructor, parameter names and stages as the torch module.

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
        self.q_proj = nn.Dense(hidden_size, 2 * num_heads * head_dim, has_bias=False)  # query and gate
        self.k_proj = nn.Dense(hidden_size, num_kv_heads * head_dim, has_bias=False)
        self.v_proj = nn.Dense(hidden_size, num_kv_heads * head_dim, has_bias=False)
        self.o_proj = nn.Dense(num_heads * head_dim, hidden_size, has_bias=False)
        self.q_norm = RMSNorm(head_dim, eps=norm_eps)
        self.k_norm = RMSNorm(head_dim, eps=norm_eps)

    def project(
        self, x_BTC: ms.Tensor, *, position_offset: int = 0
    ) -> tuple[ms.Tensor, ms.Tensor, ms.Tensor, ms.Tensor]:
        """x ``[B, T, hidden]`` whose token t sits at position ``position_offset + t`` ->
        q ``[B, H, T, D]``, k and v ``[B, Hkv, T, D]`` (q and k normed and rotated by RoPE),
        gate ``[B, T, H*D]``."""
        b, t, _ = x_BTC.shape
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        linear = mint.nn.functional.linear
        q_gate = linear(x_BTC, self.q_proj.weight).reshape(b, t, h, 2 * d)
        q_BTHD, gate_BTHD = q_gate[..., :d], q_gate[..., d:]
        q_BHTD = self.q_norm(q_BTHD).swapaxes(1, 2)
        k_BHTD = self.k_norm(linear(x_BTC, self.k_proj.weight).reshape(b, t, hkv, d)).swapaxes(1, 2)
        v_BHTD = linear(x_BTC, self.v_proj.weight).reshape(b, t, hkv, d).swapaxes(1, 2)
        positions_T = np.arange(t, dtype=np.int64) + position_offset
        cos_TD, sin_TD = rope_cos_sin(positions_T, d, self.rope_theta, q_BHTD.dtype)
        xp = ops_for(q_BHTD)
        q_BHTD = apply_rotary(xp, q_BHTD, cos_TD, sin_TD)
        k_BHTD = apply_rotary(xp, k_BHTD, cos_TD, sin_TD)
        return q_BHTD, k_BHTD, v_BHTD, gate_BTHD.reshape(b, t, h * d)

    def attend(self, q_BHTD: ms.Tensor, k_BHTD: ms.Tensor, v_BHTD: ms.Tensor, *, q_offset: int) -> ms.Tensor:
        """Causal attention -> ``[B, Tq, H*D]``: query i sits at global position ``q_offset + i``
        and sees keys ``j <= q_offset + i`` (keys are positions ``0 .. Tk-1``)."""
        return causal_attention(ops_for(q_BHTD), q_BHTD, k_BHTD, v_BHTD, q_offset=q_offset)

    def finish(self, o_BTX: ms.Tensor, gate_BTX: ms.Tensor) -> ms.Tensor:
        """Sigmoid output gate, then ``o_proj``: ``[B, T, H*D]`` -> ``[B, T, hidden]``."""
        return mint.nn.functional.linear(o_BTX * ops_for(gate_BTX).sigmoid(gate_BTX), self.o_proj.weight)

    def construct(self, hidden_states: ms.Tensor) -> ms.Tensor:
        shape = tuple(hidden_states.shape)
        if len(shape) != 3 or shape[-1] != self.hidden_size:
            raise ValueError(f"hidden_states must be [B, T, hidden_size={self.hidden_size}]; got {shape}")
        q, k, v, gate = self.project(hidden_states)
        return self.finish(self.attend(q, k, v, q_offset=0), gate)
