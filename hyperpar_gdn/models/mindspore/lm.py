"""The hybrid decoder LM as a ``mindspore.nn.Cell``: the MindSpore twin of
:class:`hyperpar_gdn.models.lm.HybridLM`, built from the same :class:`HybridLMConfig`, with the same
parameter names (``embed_tokens.weight``, ``layers.3.self_attn.q_proj.weight``, ...), so
:meth:`HybridLM.from_torch` copies a torch model's weights one to one.

The GDN mixers are :class:`~hyperpar_gdn.models.mindspore.GatedDeltaNet` (the shared maths in
``hyperpar_gdn.ops.layer``); norms use the platform's TensorOps. Written for one device:
``apply_context_parallel(model, mesh, mode=...)`` under ``HP_PLATFORM=mindspore`` makes it take and
return a sequence shard. Runs in PyNative mode.

Legend: B batch, T tokens, C hidden size, V vocabulary.
"""

from __future__ import annotations

from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Parameter, mint, nn, ops

from hyperpar_gdn.models.lm import FULL, LINEAR, HybridLMConfig

from .attention import CausalSelfAttention
from .gated_deltanet import _FROM_TORCH_DTYPES, GatedDeltaNet
from .norm import RMSNorm

__all__ = ["MLP", "DecoderBlock", "HybridLM", "HybridLMConfig", "load_torch_state_dict"]


class MLP(nn.Cell):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Dense(hidden_size, intermediate_size, has_bias=False)
        self.up_proj = nn.Dense(hidden_size, intermediate_size, has_bias=False)
        self.down_proj = nn.Dense(intermediate_size, hidden_size, has_bias=False)

    def construct(self, x: ms.Tensor) -> ms.Tensor:
        linear = mint.nn.functional.linear
        hidden = mint.nn.functional.silu(linear(x, self.gate_proj.weight)) * linear(x, self.up_proj.weight)
        return linear(hidden, self.down_proj.weight)


class DecoderBlock(nn.Cell):
    """Pre-norm block whose token mixer is ``linear_attn`` (GDN) or ``self_attn`` (softmax)."""

    def __init__(self, config: HybridLMConfig, layer_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        c = config.hidden_size
        self.input_layernorm = RMSNorm(c, eps=config.rms_norm_eps)
        if layer_type == LINEAR:
            self.linear_attn = GatedDeltaNet(
                c,
                config.linear_num_key_heads,
                config.linear_num_value_heads,
                config.linear_key_head_dim,
                config.linear_value_head_dim,
                conv_kernel_size=config.linear_conv_kernel_dim,
                norm_eps=config.rms_norm_eps,
            )
        elif layer_type == FULL:
            self.self_attn = CausalSelfAttention(
                c,
                num_heads=config.num_attention_heads,
                num_kv_heads=config.num_key_value_heads,
                head_dim=config.head_dim,
                rope_theta=config.rope_theta,
                norm_eps=config.rms_norm_eps,
            )
        else:
            raise ValueError(f"layer_type={layer_type!r} is not {LINEAR!r} or {FULL!r}")
        self.post_attention_layernorm = RMSNorm(c, eps=config.rms_norm_eps)
        self.mlp = MLP(c, config.intermediate_size)

    @property
    def mixer(self) -> nn.Cell:
        return self.linear_attn if self.layer_type == LINEAR else self.self_attn

    def construct(self, x_BTC: ms.Tensor) -> ms.Tensor:
        x_BTC = x_BTC + self.mixer(self.input_layernorm(x_BTC))
        return x_BTC + self.mlp(self.post_attention_layernorm(x_BTC))


class _Embedding(nn.Cell):
    """Token embedding with torch's parameter name ``weight`` ``[V, C]``."""

    def __init__(self, vocab_size: int, hidden_size: int, std: float) -> None:
        super().__init__()
        init = np.random.normal(0.0, std, (vocab_size, hidden_size)).astype(np.float32)
        self.weight = Parameter(ms.Tensor(init), name="weight")

    def construct(self, ids_BT: ms.Tensor) -> ms.Tensor:
        return ops.gather(self.weight, ids_BT, 0)


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
        self.embed_tokens = _Embedding(config.vocab_size, config.hidden_size, config.initializer_range)
        self.layers = nn.CellList([DecoderBlock(config, kind) for kind in config.layer_types])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self._init_weights()

    def _init_weights(self) -> None:
        """Normal(0, initializer_range) for every Dense weight, as the torch model (numpy's generator)."""
        std = self.config.initializer_range
        for _, cell in self.cells_and_names():
            if isinstance(cell, nn.Dense):
                shape = tuple(cell.weight.shape)
                cell.weight.set_data(ms.Tensor(np.random.normal(0.0, std, shape).astype(np.float32)))

    def construct(self, input_ids: ms.Tensor) -> ms.Tensor:
        if len(input_ids.shape) != 2:
            raise ValueError(f"input_ids must be [B, T]; got shape {tuple(input_ids.shape)}")
        x_BTC = self.embed_tokens(input_ids)
        for block in self.layers:
            x_BTC = block(x_BTC)
        logits_BTV = mint.nn.functional.linear(self.norm(x_BTC), self.embed_tokens.weight)
        return logits_BTV if logits_BTV.dtype in (ms.float32, ms.float64) else logits_BTV.astype(ms.float32)

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


def load_torch_state_dict(cell: nn.Cell, state_dict: dict[str, Any]) -> None:
    """Copy torch tensors into ``cell``'s parameters by name, keeping the torch dtype. Every
    parameter must be present with its shape; a torch entry the cell lacks is an error too (the
    two models must have the same parameters)."""
    params = dict(cell.parameters_and_names())
    missing, extra = sorted(set(params) - set(state_dict)), sorted(set(state_dict) - set(params))
    if missing or extra:
        raise ValueError(
            f"parameter names differ: the torch state dict lacks {missing}, the MindSpore "
            f"{type(cell).__name__} lacks {extra}"
        )
    for name, param in params.items():
        tensor = state_dict[name].detach().cpu()
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(f"{name}: torch shape {tuple(tensor.shape)} differs from {tuple(param.shape)}")
        dtype_name = str(tensor.dtype).removeprefix("torch.")
        if dtype_name not in _FROM_TORCH_DTYPES:
            raise ValueError(f"{name}: torch dtype {tensor.dtype} is not supported")
        value = ms.Tensor(tensor.float().numpy() if dtype_name == "bfloat16" else tensor.numpy())
        target = _FROM_TORCH_DTYPES[dtype_name]
        if param.dtype != target:
            param.set_dtype(target)  # set_data alone would cast the value to the old dtype
        param.set_data(value.astype(target))
