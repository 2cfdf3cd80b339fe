"""A Qwen3.5 Gated DeltaNet layer as a ``mindspore.nn.Cell``, with the torch layer's parameter names.

The maths is :func:`hyperpar_gdn.ops.gdn.layer.gdn_layer_forward`, the same code the torch layer and
the context-parallel modes run; only the parameters are MindSpore's (names and shapes as in torch
and transformers: :mod:`hyperpar_gdn.models.shells`).
"""

from __future__ import annotations

from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Parameter, nn

from hyperpar_gdn.models.mindspore.weights import assign_parameters, torch_values
from hyperpar_gdn.models.shells import GatedDeltaNetShell
from hyperpar_gdn.ops.gdn.layer import LayerDims, gated_rms_norm
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


class GatedDeltaNet(GatedDeltaNetShell, nn.Cell):
    """Qwen3.5 GDN layer for MindSpore: constructor, forward (``construct``) and arguments in
    :class:`~hyperpar_gdn.models.shells.GatedDeltaNetShell`, as the torch layer's. Runs in
    PyNative mode (the GDN maths is Python around MindSpore ops).

    Example:
        >>> layer = GatedDeltaNet(64, 2, 4, 16, 16)
        >>> tuple(layer(ms.ops.randn(2, 10, 64)).shape)
        (2, 10, 64)
        >>> ms_layer = GatedDeltaNet.from_torch(torch_layer)   # same weights as a torch layer
    """

    construct = GatedDeltaNetShell.forward

    def _linear(self, in_features: int, out_features: int) -> nn.Cell:
        return nn.Dense(in_features, out_features, has_bias=False)

    def _causal_conv(self, channels: int, width: int) -> nn.Cell:
        return CausalDepthwiseConv1d(channels, width)

    def _ones(self, name: str, size: int) -> Parameter:
        return Parameter(ms.Tensor(np.ones(size, np.float32)), name=name)

    def _log_uniform(self, name: str, size: int, low: float, high: float) -> Parameter:
        return Parameter(ms.Tensor(np.log(np.random.uniform(low, high, size)).astype(np.float32)), name=name)

    def _gated_norm(self, dim: int, eps: float) -> nn.Cell:
        return GatedRMSNorm(dim, eps=eps)

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
