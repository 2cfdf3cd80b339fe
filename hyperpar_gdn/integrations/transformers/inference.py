"""transformers' Qwen3.5 causal LMs as a CP prefill and decoding on the CP group use them
(:class:`~hyperpar_gdn.distributed.adapters.FamilyInference`): their text model's forward and
``DynamicCache`` (:mod:`.cache`), the cache cut to a rank's share and a step through their model
(:mod:`.sharded_cache`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from hyperpar_gdn.distributed.adapters import FamilyInference
from hyperpar_gdn.integrations.transformers import cache as hf_cache
from hyperpar_gdn.integrations.transformers import sharded_cache
from hyperpar_gdn.ops.prefill_states import PrefillStates
from hyperpar_gdn.platform import Tensor

__all__ = ["TransformersInference"]


class TransformersInference(FamilyInference):
    def check_prefill(self, model: Any) -> None:
        hf_cache.check_causal_lm(model)

    def prefill_hidden(
        self,
        text_model: Any,
        input_ids: Tensor,
        mask_np: np.ndarray | None,
        index: np.ndarray,
        states: PrefillStates,
        positions: np.ndarray | None = None,
    ) -> Tensor:
        return hf_cache.prefill_hidden(text_model, input_ids, mask_np, index, states, positions)

    def head(self, model: Any) -> Any:
        return model.lm_head  # called: a wrapper around it applies

    def cache(self, model: Any, text_model: Any, states: PrefillStates, *, tokens: int) -> Any:
        return hf_cache.dynamic_cache(model, text_model, states, tokens=tokens)

    def caches(self, model: Any, text_model: Any, states: PrefillStates, cu: np.ndarray) -> list[Any]:
        return hf_cache.dynamic_caches(model, text_model, states, cu)

    def decodes(self, model: Any) -> bool:
        return sharded_cache.is_causal_lm(model)

    def cut_cache(
        self, model: Any, cache: Any, *, length: int, start: int, stop: int
    ) -> tuple[Any, dict, dict]:
        return sharded_cache.cut_cache(model, cache, length=length, start=start, stop=stop)

    def step(self, model: Any, gdn: Any, ids_B1: Tensor, *, position: int, attend: Callable) -> Tensor:
        return sharded_cache.step(model, gdn, ids_B1, position=position, attend=attend)
