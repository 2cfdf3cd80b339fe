"""Qwen3.5 (dense and MoE) as MindSpore cells, loaded from and saved as a transformers model
directory (``config.json`` + safetensors), with transformers' parameter names:

    model.embed_tokens.weight                      [V, C]
    model.layers.{i}.input_layernorm.weight        [C]      (zero-centred: x / rms(x) * (1 + w))
    model.layers.{i}.linear_attn.*                 GDN      (in_proj_qkv, conv1d, A_log, norm, ...)
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight, q_norm.weight, k_norm.weight
    model.layers.{i}.post_attention_layernorm.weight
    model.layers.{i}.mlp.{gate,up,down}_proj.weight                                  (dense)
    model.layers.{i}.mlp.gate.weight, experts.{e}.*, shared_expert.*, shared_expert_gate.weight (MoE)
    model.norm.weight                              [C]
    lm_head.weight                                 [V, C]   (absent when tie_word_embeddings)

The cells are this package's shared blocks (``DecoderBlock``, ``GatedDeltaNet``,
``CausalSelfAttention`` with partial RoPE and zero-centred q/k norms, ``RMSNorm``), so the maths is
``hyperpar_gdn.ops``' and ``apply_context_parallel`` serves the model as it serves ``HybridLM``.
Text only (no vision tower, no multi-token-prediction head), no KV cache, no padding mask.

Legend: B batch, T tokens, C hidden size, V vocabulary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import nn

from hyperpar_gdn.models.directories import written_whole
from hyperpar_gdn.models.mindspore.lm import DecoderBlock, Embedding, check_input_ids, init_normal
from hyperpar_gdn.models.mindspore.norm import RMSNorm
from hyperpar_gdn.models.mindspore.weights import DTYPES, assign_parameters
from hyperpar_gdn.models.qwen35_config import Qwen35Config
from hyperpar_gdn.models.safetensors_files import read_weights, write_weights
from hyperpar_gdn.ops.blocks import lm_logits
from hyperpar_gdn.platform import ops_for

__all__ = ["Qwen35Config", "Qwen35TextModel", "Qwen3_5ForCausalLM"]

# Checkpoint entries transformers' Qwen3_5ForCausalLM also skips: the vision tower of a multimodal
# checkpoint and the multi-token-prediction head.
SKIPPED_PREFIXES = ("model.visual.", "mtp.")
MULTIMODAL_PREFIX = "model.language_model."


class Qwen35TextModel(nn.Cell):
    """Embedding, decoder blocks, final zero-centred RMSNorm: input_ids ``[B, T]`` -> hidden ``[B, T, C]``."""

    def __init__(self, config: Qwen35Config) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, config.initializer_range)
        self.layers = nn.CellList([DecoderBlock(config, kind) for kind in config.layer_types])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, zero_centred=True)

    def construct(self, input_ids: ms.Tensor, cu_seqlens: Any = None, cp_context: Any = None) -> ms.Tensor:
        check_input_ids(input_ids)
        x_BTC = self.embed_tokens(input_ids)
        for block in self.layers:
            x_BTC = block(x_BTC, cu_seqlens, cp_context)
        return self.norm(x_BTC)


class Qwen3_5ForCausalLM(nn.Cell):
    """transformers' ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM`` in MindSpore.

    construct(input_ids ``[B, T]`` int) -> logits ``[B, T, V]`` (fp32, fp64 for an fp64 model);
    token t sits at position t (under context parallelism: at its global position).

    Example:
        >>> model = Qwen3_5ForCausalLM.from_pretrained("tiny-qwen35")      # config.json + safetensors
        >>> logits = model(ms.Tensor(np.zeros((1, 16), np.int64)))
        >>> model.save_pretrained("out")   # transformers' AutoModelForCausalLM.from_pretrained("out") loads it
    """

    def __init__(self, config: Qwen35Config) -> None:
        super().__init__()
        if not isinstance(config, Qwen35Config):
            raise TypeError(f"config must be a Qwen35Config, got {type(config).__name__}")
        self.config = config
        self.model = Qwen35TextModel(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Dense(config.hidden_size, config.vocab_size, has_bias=False)
        init_normal(self, config.initializer_range)

    @property
    def head_weight(self) -> ms.Parameter:
        """``[V, C]``: ``lm_head.weight``, or the embedding's when tied."""
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def construct(self, input_ids: ms.Tensor, cu_seqlens: Any = None, cp_context: Any = None) -> ms.Tensor:
        """``cu_seqlens`` (int ``[N+1]``, B = 1): packed documents (under context parallelism: the
        global boundaries, the same on every rank); ``cp_context``: the per-forward context that
        :func:`~hyperpar_gdn.apply_context_parallel`'s wrapper of this method passes."""
        hidden_BTC = self.final_hidden_states(input_ids, cu_seqlens, cp_context)
        return lm_logits(ops_for(hidden_BTC), hidden_BTC, self.head_weight)

    def final_hidden_states(
        self, input_ids: ms.Tensor, cu_seqlens: Any = None, cp_context: Any = None
    ) -> ms.Tensor:
        """``[B, T, C]`` after the final norm: what ``head_weight`` multiplies."""
        return self.model(input_ids, cu_seqlens, cp_context)

    def num_parameters(self) -> int:
        return sum(int(np.prod(p.shape)) for p in self.get_parameters())

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: str = "float32") -> Qwen3_5ForCausalLM:
        """The model of a transformers directory, its weights cast to ``dtype`` (float32 by
        default: MindSpore has no bfloat16 matmul on CPU). Every parameter must be in the files
        and every file entry must be a parameter, except the vision tower and the MTP head
        (``model.visual.*``, ``mtp.*``) and, with tied embeddings, ``lm_head.weight``, which
        transformers skips too. A multimodal checkpoint's ``model.language_model.*`` is the text model."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is not one of {sorted(DTYPES)}")
        config = Qwen35Config.from_pretrained(path)
        model = cls(config)
        arrays = {}
        for name, array in read_weights(path).items():
            if name.startswith(SKIPPED_PREFIXES) or (config.tie_word_embeddings and name == "lm_head.weight"):
                continue
            if name.startswith(MULTIMODAL_PREFIX):
                name = "model." + name.removeprefix(MULTIMODAL_PREFIX)
            arrays.update(_split_fused_experts(name, array))
        target = DTYPES[dtype]
        values = {name: (array.astype(np.float32, copy=False), target) for name, array in arrays.items()}
        assign_parameters(model, values, source=f"the weights in {path}")
        return model

    def save_pretrained(self, out: str | Path) -> Path:
        """Write ``out/config.json`` (the text config) and ``out/model.safetensors`` (float32, one
        entry per parameter; no ``lm_head.weight`` when tied, as transformers writes it). ``out``
        appears whole or not at all (:func:`~hyperpar_gdn.models.directories.written_whole`): an
        existing one is replaced only once every file is written."""
        import json

        arrays = {name: p.value().astype(ms.float32).asnumpy() for name, p in self.parameters_and_names()}
        with written_whole(out) as temp:
            write_weights(temp, arrays)
            (temp / "config.json").write_text(
                json.dumps(self.config.to_dict(), indent=2, sort_keys=True) + "\n"
            )
        return Path(out)


def _split_fused_experts(name: str, array: np.ndarray) -> dict[str, np.ndarray]:
    """transformers' in-memory MoE layout (``mlp.experts.gate_up_proj`` ``[E, 2I, C]``,
    ``mlp.experts.down_proj`` ``[E, C, I]``) as the per-expert entries of the checkpoint format."""
    for fused in ("gate_up_proj", "down_proj"):
        suffix = f".mlp.experts.{fused}"
        if name.endswith(suffix):
            prefix = name.removesuffix(fused)
            if fused == "down_proj":
                return {f"{prefix}{e}.down_proj.weight": array[e] for e in range(array.shape[0])}
            half = array.shape[1] // 2
            out = {}
            for e in range(array.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = array[e, :half]
                out[f"{prefix}{e}.up_proj.weight"] = array[e, half:]
            return out
    return {name: array}
