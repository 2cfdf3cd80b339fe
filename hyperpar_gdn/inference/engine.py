"""A causal LM of one framework behind one interface, for a prefill and the decoding after it.

:class:`Engine` loads a transformers Qwen3.5 model directory (transformers' model on torch, the
MindSpore Qwen3.5 under ``HP_PLATFORM=mindspore``) and gives the framework's own one-device
prefill, one decoding step on one device, and one step on the CP group with the attention cache
kept sharded; :func:`kv_cache_bytes` counts the attention K/V a prefill's cache holds. Frameworks
are imported inside the functions: this module imports none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["Engine", "kv_cache_bytes"]


class Engine:
    """The model of one framework: load, prefill on one device, and one decoding step.

    Args:
        platform: the platform (:func:`hyperpar_gdn.get_platform`) whose framework loads the model.
        path: a transformers Qwen3.5 model directory.
        device: ``"cpu"``, ``"cuda"`` or ``"npu"``.

    Attributes:
        model: the loaded model (in eval mode on torch).
        cache: the decoding state :meth:`step` continues from (set it to a prefill's state).
    """

    def __init__(self, platform: Any, path: Path, *, device: str) -> None:
        self.platform = platform
        self.mindspore = platform.name == "mindspore"
        if self.mindspore:
            from hyperpar_gdn.models.mindspore import Qwen3_5ForCausalLM

            self.model = Qwen3_5ForCausalLM.from_pretrained(path)
        else:
            from hyperpar_gdn.integrations.transformers.model_dir import load_model_dir
            from hyperpar_gdn.integrations.transformers.notices import hide_expected_notices

            hide_expected_notices(device)  # transformers' reference-kernel notices, on a CPU
            self.model = load_model_dir(path)[0].eval()
        self.cache: Any = None

    def tensor(self, ids: np.ndarray) -> Any:
        """Token ids ``[B, T]`` (numpy) as the framework's int64 tensor."""
        return self.platform.from_numpy(ids, dtype="int64")

    def one_device_prefill(self, ids: Any) -> tuple[Any, Any]:
        """The framework's own prefill of ``ids`` ``[B, T]`` -> (last logits ``[B, V]``, cache)."""
        if self.mindspore:
            from hyperpar_gdn.inference.decoding import prefill

            return prefill(self.model, ids)
        import torch

        with torch.no_grad():
            out = self.model(input_ids=ids, use_cache=True)
        return out.logits[:, -1], out.cache

    def step(self, token: np.ndarray) -> np.ndarray:
        """Logits ``[B, V]`` (numpy) after one more token per row ``[B, 1]``, from :attr:`cache`."""
        ids = self.tensor(token)
        if self.mindspore:
            from hyperpar_gdn.inference.decoding import decode_step

            logits, self.cache = decode_step(self.model, self.cache, ids)
            return self.platform.to_numpy(logits)
        import torch

        with torch.no_grad():
            out = self.model(input_ids=ids, cache=self.cache, use_cache=True)
        self.cache = out.cache
        return out.logits[:, -1].float().numpy()

    def group_step(self, mesh: Any, sharded: Any, token: np.ndarray) -> np.ndarray:
        """:meth:`step` on the CP group with the K/V cache sharded (every rank calls it)."""
        from hyperpar_gdn.inference.cp_decoding import decode_step_context_parallel

        logits = decode_step_context_parallel(self.model, mesh, sharded, self.tensor(token))
        return self.platform.to_numpy(logits)


def kv_cache_bytes(cache: Any) -> int:
    """Bytes of the attention layers' K and V in a prefill's cache (what one device keeps):
    transformers' ``DynamicCache``, or the MindSpore model's ``DecodingState``."""
    from hyperpar_gdn.inference.decoding import DecodingState

    if isinstance(cache, DecodingState):  # a GDN layer's pair is (conv [B, C, W], S): 3-d and 4-d
        pairs = [pair for pair in cache.layers if len(pair[0].shape) == len(pair[1].shape) == 4]
    else:
        pairs = [
            (layer.keys, layer.values) for layer in cache.layers if getattr(layer, "keys", None) is not None
        ]
    return sum(int(t.nbytes) for pair in pairs for t in pair)
