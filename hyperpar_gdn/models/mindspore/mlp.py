"""The SwiGLU MLP as a MindSpore cell with transformers' names (``gate_proj``, ``up_proj``,
``down_proj``, weights ``[out, in]``): the dense MLP of a decoder block and each expert of
:class:`~hyperpar_gdn.models.mindspore.moe.SparseMoeBlock`. The maths is
:func:`hyperpar_gdn.ops.blocks.swiglu`."""

from __future__ import annotations

import mindspore as ms
from mindspore import nn

from hyperpar_gdn.ops.blocks import swiglu
from hyperpar_gdn.platform import ops_for

__all__ = ["MLP"]


class MLP(nn.Cell):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Dense(hidden_size, intermediate_size, has_bias=False)
        self.up_proj = nn.Dense(hidden_size, intermediate_size, has_bias=False)
        self.down_proj = nn.Dense(intermediate_size, hidden_size, has_bias=False)

    def construct(self, x: ms.Tensor) -> ms.Tensor:
        return swiglu(ops_for(x), x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)
