"""Tensor parallelism: Qwen3.5 models' blocks split by heads and columns over a TP axis.

torch:

- :mod:`.apply`: ``apply_tensor_parallel(model, mesh["tp"])``, the plan and its checks, and the
  whole state of a TP model in the single-device layout (``canonical_state_dict``).
- :mod:`.styles`: torch ``ParallelStyle`` s of the GDN layer, the attention, the MLP, the MoE block.
- :mod:`.comm`: the all-reduces (a block's output, its input's gradient, the gradients of the
  parameters every rank holds whole), and ``count_tp_traffic``.

MindSpore: :mod:`.mindspore_styles` (the GDN layer, the attention, the MLP and the MoE cells
split over a TP group through the platform's collectives) and :mod:`.mindspore_apply` (a whole
model). The names below load their module on first use, so
the MindSpore side imports without torch.

docs/tensor_parallel.md is the guide.
"""

from hyperpar_gdn._lazy import lazy_exports

_EXPORTS = {
    "TPTraffic": "hyperpar_gdn.tensor_parallel.comm",
    "apply_tensor_parallel": "hyperpar_gdn.tensor_parallel.apply",
    "canonical_grads": "hyperpar_gdn.tensor_parallel.apply",
    "canonical_state_dict": "hyperpar_gdn.tensor_parallel.apply",
    "count_tp_traffic": "hyperpar_gdn.tensor_parallel.comm",
    "tensor_parallel_plan": "hyperpar_gdn.tensor_parallel.apply",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
