"""Tensor parallelism (torch): Qwen3.5 models' blocks split by heads and columns over a TP axis.

- :mod:`.apply`: ``apply_tensor_parallel(model, mesh["tp"])``, the plan and its checks, and the
  whole state of a TP model in the single-device layout (``canonical_state_dict``).
- :mod:`.styles`: torch ``ParallelStyle`` s of the GDN layer, the attention, the MLP, the MoE block.
- :mod:`.comm`: the all-reduces (a block's output, its input's gradient, the gradients of the
  parameters every rank holds whole), and ``count_tp_traffic``.

docs/tensor_parallel.md is the guide.
"""

from hyperpar_gdn.tensor_parallel.apply import (
    apply_tensor_parallel,
    canonical_grads,
    canonical_state_dict,
    tensor_parallel_plan,
)
from hyperpar_gdn.tensor_parallel.comm import TPTraffic, count_tp_traffic

__all__ = [
    "TPTraffic",
    "apply_tensor_parallel",
    "canonical_grads",
    "canonical_state_dict",
    "count_tp_traffic",
    "tensor_parallel_plan",
]
