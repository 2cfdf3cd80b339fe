"""The hybrid decoder LM as a ``mindspore.nn.Cell``: the MindSpore twin of
:class:`hyperpar_gdn.models.lm.HybridLM`, built from the same :class:`HybridLMConfig`, with the same
parameter names (``embed_tokens.weight``, ``layers.3.self_attn.q_proj.weight``, ...), so
:meth:`HybridLM.from_torch` copies a torch model's weights one to one.

The blocks here (:class:`DecoderBlock`, :class:`Embedding`) also build the Qwen3.5 model
(:mod:`.qwen35`): they read the block-building interface of either config (``layer_types``,
``gdn_kwargs()``, ``attention_kwargs()``, ``zero_centred_norms``, ``num_experts``); the MLPs are
in :mod:`.mlp` (SwiGLU) and :mod:`.moe` (experts). The maths is ``hyperpar_gdn.ops`` (``blocks``,
``attention``, ``gdn.layer``). :class:`HybridLMConfig` comes from :mod:`hyperpar_gdn.models.config`
(no framework).
Written for one device: ``apply_context_parallel(model, mesh, mode=...)`` under
``HP_PLATFORM=mindspore`` makes it take and return a sequence shard. Runs in PyNative mode.

Legend: B batch, T tokens, C hidden size, V vocabulary.
"""

from __future__ import annotations

from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Parameter, nn, ops

from hyperpar_gdn.models.config import HybridLMConfig
from hyperpar_gdn.models.mindspore.attention import CausalSelfAttention
from hyperpar_gdn.models.mindspore.gated_deltanet import GatedDeltaNet
from hyperpar_gdn.models.mindspore.mlp import MLP
from hyperpar_gdn.models.mindspore.moe import SparseMoeBlock
from hyperpar_gdn.models.mindspore.norm import RMSNorm
from hyperpar_gdn.models.mindspore.weights import load_torch_state_dict
from hyperpar_gdn.models.shells import DecoderBlockShell
from hyperpar_gdn.ops.blocks import lm_logits
from hyperpar_gdn.platform import ops_for

__all__ = [
    "MLP",
    "DecoderBlock",
    "Embedding",
    "HybridLM",
    "HybridLMConfig",
    "init_normal",
    "load_torch_state_dict",
]


class DecoderBlock(DecoderBlockShell, nn.Cell):
    """Pre-norm decoder block (:class:`~hyperpar_gdn.models.shells.DecoderBlockShell`) for
    MindSpore, whose ``mlp`` is SwiGLU or, for a config with ``num_experts``, Qwen3.5-MoE's sparse
    block."""

    construct = DecoderBlockShell.forward

    def _rms_norm(self, config: Any) -> nn.Cell:
        return RMSNorm(config.hidden_size, eps=config.rms_norm_eps, zero_centred=config.zero_centred_norms)

    def _gdn(self, config: Any) -> nn.Cell:
        return GatedDeltaNet(**config.gdn_kwargs())

    def _attention(self, config: Any) -> nn.Cell:
        return CausalSelfAttention(**config.attention_kwargs())

    def _mlp(self, config: Any) -> nn.Cell:
        if config.num_experts:
            return SparseMoeBlock(**config.moe_kwargs())
        return MLP(config.hidden_size, config.intermediate_size)


class Embedding(nn.Cell):
    """Token embedding with torch's parameter name ``weight`` ``[V, C]``: ids ``[B, T]`` -> ``[B, T, C]``."""

    def __init__(self, vocab_size: int, hidden_size: int, std: float) -> None:
        super().__init__()
        init = np.random.normal(0.0, std, (vocab_size, hidden_size)).astype(np.float32)
        self.weight = Parameter(ms.Tensor(init), name="weight")

    def construct(self, ids_BT: ms.Tensor) -> ms.Tensor:
        return ops.gather(self.weight, ids_BT, 0)


def init_normal(cell: nn.Cell, std: float) -> None:
    """Normal(0, std) for every Dense weight under ``cell`` (numpy's generator), as the torch
    models initialise their Linear layers."""
    for _, sub in cell.cells_and_names():
        if isinstance(sub, nn.Dense):
            shape = tuple(sub.weight.shape)
            sub.weight.set_data(ms.Tensor(np.random.normal(0.0, std, shape).astype(np.float32)))


def check_input_ids(input_ids: ms.Tensor) -> None:
    if len(input_ids.shape) != 2:
        raise ValueError(f"input_ids must be [B, T]; got shape {tuple(input_ids.shape)}")


class HybridLM(nn.Cell):
    """Decoder LM: embedding, :class:`DecoderBlock` s, final RMSNorm, tied LM head.

    construct(input_ids ``[B, T]`` int) -> logits ``[B, T, V]`` (fp32, or fp64 for an fp64 model).
    Token t sits at position t (under context parallelism: at its global position).

    Example:
        >>> model = HybridLM(HybridLMConfig(num_layers=4))
        >>> tuple(model(ms.Tensor(np.zeros((2, 16), np.int64))).shape)
        (2, 16, 256)
        >>> ms_model = HybridLM.from_torch(torch_model)   # the torch model's config and weights
    """

    def __init__(self, config: HybridLMConfig) -> None:
        super().__init__()
        if not isinstance(config, HybridLMConfig):
            raise TypeError(f"config must be a HybridLMConfig, got {type(config).__name__}")
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, config.initializer_range)
        self.layers = nn.CellList([DecoderBlock(config, kind) for kind in config.layer_types])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        init_normal(self, config.initializer_range)

    def construct(self, input_ids: ms.Tensor, cu_seqlens: Any = None, cp_context: Any = None) -> ms.Tensor:
        """``cu_seqlens`` (int ``[N+1]``, B = 1): packed documents (under context parallelism: the
        global boundaries, the same on every rank); ``cp_context``: the per-forward context that
        :func:`~hyperpar_gdn.apply_context_parallel`'s wrapper of this method passes."""
        hidden_BTC = self.final_hidden_states(input_ids, cu_seqlens, cp_context)
        return lm_logits(ops_for(hidden_BTC), hidden_BTC, self.embed_tokens.weight)

    def final_hidden_states(
        self, input_ids: ms.Tensor, cu_seqlens: Any = None, cp_context: Any = None
    ) -> ms.Tensor:
        """``[B, T, C]`` after the final norm: what the tied head (``head_weight``) multiplies."""
        check_input_ids(input_ids)
        x_BTC = self.embed_tokens(input_ids)
        for block in self.layers:
            x_BTC = block(x_BTC, cu_seqlens, cp_context)
        return self.norm(x_BTC)

    @property
    def head_weight(self) -> ms.Parameter:
        """``[V, C]``: the embedding's weight (the head is tied)."""
        return self.embed_tokens.weight

    def num_parameters(self) -> int:
        return sum(int(np.prod(p.shape)) for p in self.get_parameters())

    @classmethod
    def from_torch(cls, model: Any) -> HybridLM:
        """A MindSpore model with the config and a copy of the weights (and their dtype) of a torch
        :class:`hyperpar_gdn.models.lm.HybridLM`."""
        config = getattr(model, "config", None)
        if not isinstance(config, HybridLMConfig):
            raise TypeError(
                f"from_torch needs a torch hyperpar_gdn.models.lm.HybridLM (with a HybridLMConfig), "
                f"got {type(model).__name__}"
            )
        ms_model = cls(config)
        load_torch_state_dict(ms_model, model.state_dict())
        return ms_model
