"""A Qwen3.5 Gated DeltaNet layer as a ``mindspore.nn.Cell``, with the torch layer's parameter names.

The maths is :func:`hyperpar_gdn.ops.gdn.layer.gdn_layer_forward`, the same code the torch layer and
the context-parallel modes run; only the parameters are MindSpore's. Parameters (shapes as in
torch and transformers, so weights copy over one to one):

    in_proj_qkv.weight [C, hidden]   in_proj_z.weight [H*Dv, hidden]   in_proj_b.weight [H, hidden]
    in_proj_a.weight [H, hidden]     conv1d.weight [C, 1, W]           A_log [H]   dt_bias [H]
    norm.weight [Dv]                 out_proj.weight [hidden, H*Dv]

with C = 2*Hk*Dk + H*Dv.
"""

from __future__ import annotations

from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Parameter, nn

from hyperpar_gdn.models.mindspore.weights import assign_parameters, torch_values
from hyperpar_gdn.ops.gdn.layer import LayerDims, gated_rms_norm, init_layer_dims, layer_forward
from hyperpar_gdn.ops.prefill_states import PrefillStates
from hyperpar_gdn.platform import ops_for

__all__ = ["CausalDepthwiseConv1d", "GatedDeltaNet", "GatedRMSNorm"]


class GatedRMSNorm(nn.Cell):
    """``weight * x / rms(x) * silu(gate)`` over the last dim (normalised in fp32).

    Example:
        >>> norm = GatedRMSNorm(8)
        >>> tuple(norm(ms.ops.ones((2, 3, 8)), ms.ops.ones((2, 3, 8))).shape)
        (2, 3, 8)
    """

    def __init__(self, dim: int, *, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = Parameter(ms.Tensor(np.ones(dim, np.float32)), name="weight")
        self.variance_epsilon = eps

    def construct(self, x: ms.Tensor, gate: ms.Tensor) -> ms.Tensor:
        return gated_rms_norm(ops_for(x), x, gate, self.weight, self.variance_epsilon)


class CausalDepthwiseConv1d(nn.Cell):
    """Depthwise causal conv over time with torch's weight layout ``[C, 1, W]`` (MindSpore's own
    ``nn.Conv1d`` keeps ``[C, 1, 1, W]``), no bias: ``[B, C, T] -> [B, C, T]``."""

    def __init__(self, channels: int, kernel_size: int) -> None:
        super().__init__()
        bound = 1.0 / np.sqrt(kernel_size)  # torch's default init for a depthwise conv
        init = np.random.uniform(-bound, bound, (channels, 1, kernel_size)).astype(np.float32)
        self.weight = Parameter(ms.Tensor(init), name="weight")
        self.kernel_size = kernel_size

    def construct(self, x: ms.Tensor) -> ms.Tensor:
        channels, _, width = self.weight.shape
        return ops_for(x).depthwise_conv1d(x, self.weight.reshape(channels, width), left_pad=width - 1)


class GatedDeltaNet(nn.Cell):
    """Qwen3.5 GDN layer for MindSpore; same constructor and parameter names as
    :class:`hyperpar_gdn.models.GatedDeltaNet` (torch) and transformers' ``Qwen3_5GatedDeltaNet``.

    Args:
        hidden_size: model width.
        num_k_heads, num_v_heads: query/key heads and value heads (num_v_heads a multiple).
        head_k_dim, head_v_dim: per-head dims.
        conv_kernel_size: width W of the causal depthwise conv.
        norm_eps: epsilon of the gated RMSNorm.

    construct(hidden_states ``[B, T, hidden]``, attention_mask ``[B, T]`` or None, *, cu_seqlens=None,
    position_ids=None) -> ``[B, T, hidden]``; packed documents as in the torch layer.
    Runs in PyNative mode (the GDN maths is Python around MindSpore ops).

    Example:
        >>> layer = GatedDeltaNet(64, 2, 4, 16, 16)
        >>> tuple(layer(ms.ops.randn(2, 10, 64)).shape)
        (2, 10, 64)
        >>> ms_layer = GatedDeltaNet.from_torch(torch_layer)   # same weights as a torch layer
    """

    def __init__(
        self,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel_size: int = 4,
        norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        init_layer_dims(
            self,
            hidden_size=hidden_size,
            num_k_heads=num_k_heads,
            num_v_heads=num_v_heads,
            head_k_dim=head_k_dim,
            head_v_dim=head_v_dim,
            conv_kernel_size=conv_kernel_size,
            norm_eps=norm_eps,
        )

        self.in_proj_qkv = nn.Dense(hidden_size, self.conv_dim, has_bias=False)
        self.in_proj_z = nn.Dense(hidden_size, self.value_dim, has_bias=False)
        self.in_proj_b = nn.Dense(hidden_size, num_v_heads, has_bias=False)
        self.in_proj_a = nn.Dense(hidden_size, num_v_heads, has_bias=False)
        self.conv1d = CausalDepthwiseConv1d(self.conv_dim, conv_kernel_size)
        self.dt_bias = Parameter(ms.Tensor(np.ones(num_v_heads, np.float32)), name="dt_bias")
        a = np.random.uniform(0.01, 16, num_v_heads)
        self.A_log = Parameter(ms.Tensor(np.log(a).astype(np.float32)), name="A_log")
        self.norm = GatedRMSNorm(head_v_dim, eps=norm_eps)
        self.out_proj = nn.Dense(self.value_dim, hidden_size, has_bias=False)

    def construct(
        self,
        hidden_states: ms.Tensor,
        attention_mask: ms.Tensor | None = None,
        *,
        cu_seqlens: ms.Tensor | None = None,
        position_ids: ms.Tensor | None = None,
        prefill_states: PrefillStates | None = None,
    ) -> ms.Tensor:
        """The layer on ``hidden_states`` ``[B, T, hidden]`` -> ``[B, T, hidden]``.

        Args:
            attention_mask: ``[B, T]`` (1 = token, 0 = padding): padded rows are zeroed before the
                projections, or None.
            cu_seqlens: packed documents (B = 1), int ``[N+1]``: the state and the causal conv
                restart at every document. Under context parallelism: the whole sequence's
                boundaries, the same tensor on every rank.
            position_ids: ``[B, T]`` restarting at 0 at every document (transformers' packed
                convention); one device only (a shard's positions cannot say where the documents
                of other shards start).
            prefill_states: an inference prefill's record
                (:class:`~hyperpar_gdn.ops.prefill_states.PrefillStates`): the layer hands it its
                decoding state after the last token.

        After :class:`~hyperpar_gdn.LinearAttentionContextParallel` ``.apply``, ``hidden_states``
        and the result are this rank's shard ``[B, T_r, hidden]`` (and ``attention_mask`` its
        ``[B, T_r]`` shard).
        """
        return layer_forward(
            self,
            hidden_states,
            attention_mask,
            cu_seqlens=cu_seqlens,
            position_ids=position_ids,
            prefill_states=prefill_states,
        )

    @classmethod
    def from_torch(cls, module: Any) -> GatedDeltaNet:
        """A MindSpore layer with the dimensions and a copy of the weights (and their dtype) of a
        torch GDN layer: ours (:class:`hyperpar_gdn.models.GatedDeltaNet`) or transformers'
        ``Qwen3_5GatedDeltaNet``. Raises ``ValueError`` naming any parameter that is missing or
        whose shape differs."""
        dims = LayerDims.of(module)
        layer = cls(
            dims.hidden_size,
            dims.num_k_heads,
            dims.num_v_heads,
            dims.head_k_dim,
            dims.head_v_dim,
            conv_kernel_size=dims.conv_kernel_size,
            norm_eps=dims.norm_eps,
        )
        layer.load_torch_state_dict(module.state_dict())
        return layer

    def load_torch_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Copy torch tensors (a torch layer's ``state_dict()``) into this layer's parameters, by
        name, keeping the torch dtype (float32, float64, bfloat16 or float16). Every parameter
        must be present with its shape; other entries (buffers) are ignored."""
        assign_parameters(self, torch_values(state_dict), source="the torch state dict", allow_extra=True)
