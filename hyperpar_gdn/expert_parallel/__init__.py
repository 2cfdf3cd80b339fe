"""Expert parallelism (torch): a MoE block's routed experts split by expert over an EP group.

- :mod:`.grouped`: the experts' SwiGLU on rows grouped by expert (grouped matmul, loop reference).
- :mod:`.dispatch`: the dropless all-to-all dispatch and combine, and its traffic count.
- :mod:`.router_loss`: the router's load-balancing loss over a batch split across ranks.
- :mod:`.style`: ``ExpertParallel`` (one block) and ``apply_expert_parallel`` (a whole model).

docs/expert_parallel.md is the guide.
"""

from hyperpar_gdn.expert_parallel.dispatch import EPTraffic, count_ep_traffic, expert_parallel_experts
from hyperpar_gdn.expert_parallel.grouped import grouped_swiglu, grouped_swiglu_loop
from hyperpar_gdn.expert_parallel.router_loss import load_balancing_loss, record_router_logits
from hyperpar_gdn.expert_parallel.style import ExpertParallel, apply_expert_parallel, expert_parallel_error

__all__ = [
    "EPTraffic",
    "ExpertParallel",
    "apply_expert_parallel",
    "count_ep_traffic",
    "expert_parallel_error",
    "expert_parallel_experts",
    "grouped_swiglu",
    "grouped_swiglu_loop",
    "load_balancing_loss",
    "record_router_logits",
]
