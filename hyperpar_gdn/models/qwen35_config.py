"""The text configuration of a transformers Qwen3.5 model directory, read from its ``config.json``
without transformers: dense (``qwen3_5_text``) or MoE (``qwen3_5_moe_text``), or the
``text_config`` of a multimodal ``qwen3_5`` / ``qwen3_5_moe`` directory.

Fields that change the maths and that the MindSpore model does not implement are refused with a
``NotImplementedError`` naming the field (``attention_bias: true``, a RoPE type other than
``default``, an activation other than ``silu``, attention dropout, ``output_router_logits``).
Fields that do not change the forward (token ids, ``max_position_embeddings``, ``use_cache``,
``initializer_range``, the mrope layout, which is a no-op for text positions) are kept and written
back by :meth:`Qwen35Config.to_dict`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hyperpar_gdn.models.block_config import DecoderSizes

__all__ = ["MODEL_TYPES", "Qwen35Config", "read_config"]

DENSE, MOE = "qwen3_5_text", "qwen3_5_moe_text"
MULTIMODAL = {"qwen3_5": DENSE, "qwen3_5_moe": MOE}
MODEL_TYPES = (DENSE, MOE, *MULTIMODAL)  # what a Qwen3.5 directory's config.json may name
ARCHITECTURES = {DENSE: "Qwen3_5ForCausalLM", MOE: "Qwen3_5MoeForCausalLM"}
LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(kw_only=True, frozen=True)
class Qwen35Config(DecoderSizes):
    """What the MindSpore Qwen3.5 model needs from ``config.json`` (names as transformers').

    ``source`` is the text config as read (written back by :meth:`to_dict`). Build with
    :meth:`from_dict` or :meth:`from_pretrained`, which check everything."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    rope_theta: float
    partial_rotary_factor: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    initializer_range: float = 0.02
    intermediate_size: int = 0  # dense
    num_experts: int = 0  # MoE
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    source: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    zero_centred_norms = True  # Qwen3_5RMSNorm: x / rms(x) * (1 + weight)

    @property
    def rotary_dim(self) -> int:  # type: ignore[override]
        """The leading dims of each attention head that RoPE rotates (transformers' ``int(D * factor)``)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Qwen35Config:
        """The config of the model directory ``path`` (its ``config.json``)."""
        return cls.from_dict(read_config(path), where=str(Path(path) / "config.json"))

    @classmethod
    def from_dict(
        cls, config: dict[str, Any], *, where: str = "config", sizes_only: bool = False
    ) -> Qwen35Config:
        """Parse a transformers config dict (text or multimodal); every error names ``where`` and the
        field. ``sizes_only``: accept the fields the MindSpore model does not implement (for what
        reads only the sizes, as the memory plan of a torch run)."""
        model_type = config.get("model_type")
        if model_type in MULTIMODAL:
            text = dict(config.get("text_config") or {})
            text.setdefault("model_type", MULTIMODAL[model_type])
            if "tie_word_embeddings" not in text and "tie_word_embeddings" in config:
                text["tie_word_embeddings"] = config["tie_word_embeddings"]
            return cls.from_dict(text, where=f"{where}: text_config", sizes_only=sizes_only)
        if model_type not in (DENSE, MOE):
            raise ValueError(_not_qwen35(model_type, where))
        if not sizes_only:
            _refuse_unsupported(config, where)
        n = _int(config, "num_hidden_layers", where)
        layer_types = config.get("layer_types")
        if layer_types is None:
            interval = int(config.get("full_attention_interval", 4))
            layer_types = [LAYER_TYPES[(i + 1) % interval == 0] for i in range(n)]
        if len(layer_types) != n or not set(layer_types) <= set(LAYER_TYPES):
            raise ValueError(
                f"{where}: layer_types {layer_types} must be {n} (num_hidden_layers) entries of {LAYER_TYPES}"
            )
        rope = config.get("rope_parameters") or {}
        heads = _int(config, "num_attention_heads", where)
        moe = model_type == MOE
        sizes = (
            {
                name: _int(config, name, where)
                for name in (
                    "num_experts",
                    "num_experts_per_tok",
                    "moe_intermediate_size",
                    "shared_expert_intermediate_size",
                )
            }
            if moe
            else {"intermediate_size": _int(config, "intermediate_size", where)}
        )
        parsed = cls(
            model_type=model_type,
            vocab_size=_int(config, "vocab_size", where),
            hidden_size=_int(config, "hidden_size", where),
            num_hidden_layers=n,
            layer_types=tuple(layer_types),
            num_attention_heads=heads,
            num_key_value_heads=_int(config, "num_key_value_heads", where),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
            linear_num_key_heads=_int(config, "linear_num_key_heads", where),
            linear_num_value_heads=_int(config, "linear_num_value_heads", where),
            linear_key_head_dim=_int(config, "linear_key_head_dim", where),
            linear_value_head_dim=_int(config, "linear_value_head_dim", where),
            linear_conv_kernel_dim=int(config.get("linear_conv_kernel_dim", 4)),
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
            partial_rotary_factor=float(
                rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25))
            ),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            initializer_range=float(config.get("initializer_range", 0.02)),
            source=dict(config),
            **sizes,
        )
        if parsed.num_experts_per_tok > parsed.num_experts:
            raise ValueError(
                f"{where}: num_experts_per_tok={parsed.num_experts_per_tok} exceeds num_experts={parsed.num_experts}"
            )
        if parsed.rotary_dim % 2 or parsed.rotary_dim < 2:
            raise ValueError(
                f"{where}: head_dim={parsed.head_dim} x partial_rotary_factor={parsed.partial_rotary_factor} "
                f"= {parsed.rotary_dim} rotary dims; RoPE needs an even number >= 2"
            )
        return parsed

    def to_dict(self) -> dict[str, Any]:
        """The ``config.json`` of a text-only transformers directory for this model (float32
        weights): the text config as read, with the text model type and its causal-LM class."""
        out = dict(self.source)
        out.update(
            model_type=self.model_type,
            architectures=[ARCHITECTURES[self.model_type]],
            tie_word_embeddings=self.tie_word_embeddings,
            dtype="float32",
        )
        out.pop("torch_dtype", None)
        return out

    # --- the block-building interface beyond DecoderSizes' ------------------------------------
    def moe_kwargs(self) -> dict[str, Any]:
        return {
            "hidden_size": self.hidden_size,
            "num_experts": self.num_experts,
            "top_k": self.num_experts_per_tok,
            "intermediate_size": self.moe_intermediate_size,
            "shared_intermediate_size": self.shared_expert_intermediate_size,
        }


def read_config(path: str | Path, *, option: str = "") -> dict[str, Any]:
    """``path/config.json`` of a Qwen3.5 model directory as a dict, multimodal ones whole, checked:
    it exists, is JSON and names a Qwen3.5 model type (:data:`MODEL_TYPES`). The one reader of
    a model directory's config (no transformers, no framework); ``option`` (``"--model"``)
    begins its errors."""
    where = f"{option} {path}" if option else str(path)
    file = Path(path) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{where}: no config.json there (expected a transformers model directory)")
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: config.json is not valid JSON ({err})") from None
    if not isinstance(config, dict) or config.get("model_type") not in MODEL_TYPES:
        model_type = config.get("model_type") if isinstance(config, dict) else None
        raise ValueError(_not_qwen35(model_type, where))
    return config


def _not_qwen35(model_type: Any, where: str) -> str:
    return f"{where}: model_type {model_type!r} is not a Qwen3.5 model; supported: {', '.join(MODEL_TYPES)}"


def _int(config: dict[str, Any], name: str, where: str) -> int:
    value = config.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: {name} must be a positive int; got {value!r}")
    return value


def _refuse_unsupported(config: dict[str, Any], where: str) -> None:
    """NotImplementedError for every field whose value changes maths the model does not have."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    checks = {
        "attention_bias": (config.get("attention_bias", False), False),
        "rope_parameters.rope_type": (rope_type, "default"),
        "hidden_act": (config.get("hidden_act", "silu"), "silu"),
        "attention_dropout": (float(config.get("attention_dropout", 0.0)), 0.0),
        "output_router_logits": (config.get("output_router_logits", False), False),
    }
    for name, (value, supported) in checks.items():
        if value != supported:
            raise NotImplementedError(
                f"{where}: {name}={value!r} is not implemented by the MindSpore Qwen3.5 model "
                f"(it supports {name}={supported!r})"
            )
