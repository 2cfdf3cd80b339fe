"""transformers' GDN layer split by heads (tensor parallelism): its call signature over the
library's layer stages, which read the rank's local weights, and with a ``DynamicCache``
(``generate``, a decoding step) the cache holds the local heads' states."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hyperpar_gdn.distributed.parallel_style import refuse_unhandled
from hyperpar_gdn.integrations.transformers.cache import gdn_forward_with_cache
from hyperpar_gdn.ops.gdn.layer import layer_forward
from hyperpar_gdn.platform import Tensor

__all__ = ["head_sharded_gdn_forward"]


def head_sharded_gdn_forward(module: Any) -> Callable:
    """The forward of transformers' GDN layer ``module`` on its local heads (its own forward
    would read the whole weights): ``hidden_states`` ``[B, T, hidden]`` -> this rank's share of
    the output ``[B, T, hidden]`` (the tensor-parallel style sums it over the group)."""

    def forward(
        hidden_states: Tensor,
        attention_mask: Any = None,
        cache: Any = None,
        cache_params: Any = None,
        cu_seq_lens_q: Any = None,
        prefill_states: Any = None,
        **kwargs: Any,
    ) -> Tensor:
        kwargs.pop("use_cache", None)  # generate's: the cache given is what counts
        refuse_unhandled(type(module).__name__, kwargs)
        cache = cache if cache is not None else cache_params
        if cache is not None:
            return gdn_forward_with_cache(
                module, hidden_states, attention_mask, cache, cu_seqlens=cu_seq_lens_q
            )
        return layer_forward(
            module, hidden_states, attention_mask, cu_seqlens=cu_seq_lens_q, prefill_states=prefill_states
        )

    return forward
