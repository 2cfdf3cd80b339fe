"""Qwen3.5-MoE's sparse MLP block as a MindSpore cell with transformers' checkpoint names
(``gate.weight`` ``[E, C]``, ``experts.{e}.{gate,up,down}_proj.weight``, ``shared_expert.*``,
``shared_expert_gate.weight`` ``[1, C]``); the maths is :func:`hyperpar_gdn.ops.blocks.sparse_moe`."""

from __future__ import annotations

import mindspore as ms
from mindspore import nn

from hyperpar_gdn.models.mindspore.mlp import MLP
from hyperpar_gdn.ops.blocks import sparse_moe
from hyperpar_gdn.platform import ops_for

__all__ = ["SparseMoeBlock", "expert_weights"]


def expert_weights(mlp: MLP) -> tuple[ms.Parameter, ms.Parameter, ms.Parameter]:
    """An expert's (gate, up, down) weights, as :func:`~hyperpar_gdn.ops.blocks.sparse_moe` takes them."""
    return mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight


class SparseMoeBlock(nn.Cell):
    """Top-k routed SwiGLU experts plus a sigmoid-gated shared expert: ``[..., C]`` -> ``[..., C]``.

    Args:
        hidden_size: C.
        num_experts: E; top_k: experts per token (routing weights renormalised over them).
        intermediate_size: each routed expert's width; shared_intermediate_size: the shared one's.
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        shared_intermediate_size: int,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        self.top_k = top_k
        self.gate = nn.Dense(hidden_size, num_experts, has_bias=False)
        self.experts = nn.CellList([MLP(hidden_size, intermediate_size) for _ in range(num_experts)])
        self.shared_expert = MLP(hidden_size, shared_intermediate_size)
        self.shared_expert_gate = nn.Dense(hidden_size, 1, has_bias=False)

    def construct(self, x: ms.Tensor) -> ms.Tensor:
        return sparse_moe(
            ops_for(x),
            x,
            router=self.gate.weight,
            experts=[expert_weights(expert) for expert in self.experts],
            top_k=self.top_k,
            shared=expert_weights(self.shared_expert),
            shared_gate=self.shared_expert_gate.weight,
        )
