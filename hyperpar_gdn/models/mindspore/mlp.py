"""The SwiGLU MLP as a MindSpore cell, with torch's and transformers' parameter names
(``gate_proj``, ``up_proj``, ``down_proj``): a decoder block's dense MLP and each expert of the
sparse MoE block. The maths is :func:`hyperpar_gdn.ops.blocks.swiglu`."""

from __future__ import annotations

from mindspore import nn

from hyperpar_gdn.models.shells import MLPShell

__all__ = ["MLP"]


class MLP(MLPShell, nn.Cell):
    """SwiGLU (:class:`~hyperpar_gdn.models.shells.MLPShell`) for MindSpore."""

    construct = MLPShell.forward

    def _linear(self, in_features: int, out_features: int) -> nn.Cell:
        return nn.Dense(in_features, out_features, has_bias=False)
