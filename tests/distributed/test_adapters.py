"""The model adapters' registry: each model family is served by the adapter that does not
decline it (ours, transformers'), asked by the core instead of a type name; a model or layer that
none serves is refused with every adapter's reason; a family registered from outside is found;
a module's family (what tensor parallelism and inference ask) is the adapter that owns it, else ours."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from tiny_models import TINY_LM, tiny_model

from hyperpar_gdn.distributed.adapters import ADAPTERS, FamilyInference, register_adapter
from hyperpar_gdn.distributed.decoder_layers import (
    DecoderAdapter,
    adapter_for,
    find_decoder,
    is_silu,
    layer_adapter_for,
    mixers_of,
    module_adapter_for,
)
from hyperpar_gdn.distributed.softmax_attention_style import SoftmaxAttentionContextParallel
from hyperpar_gdn.integrations.transformers.adapter import TransformersAdapter
from hyperpar_gdn.models import HybridLM


def test_each_family_has_its_adapter() -> None:
    ours, theirs = HybridLM(TINY_LM), tiny_model(moe=False)
    assert type(adapter_for(ours)) is DecoderAdapter
    assert type(adapter_for(theirs)) is TransformersAdapter
    assert find_decoder(ours) == (None, ours)
    assert find_decoder(theirs) == (None, theirs.model)
    for model, adapter in ((ours, DecoderAdapter), (theirs, TransformersAdapter)):
        attention = [m for kind, m in mixers_of(find_decoder(model)[1]) if kind == "self_attn"]
        assert [type(layer_adapter_for(m)) for m in attention] == [adapter], model


def test_what_no_adapter_serves_is_refused_with_every_reason() -> None:
    with pytest.raises(ValueError) as model_error:
        adapter_for(torch.nn.Linear(2, 2))
    for cls in ADAPTERS:
        assert f"{cls.name}: {cls.declines(torch.nn.Linear(2, 2))}" in str(model_error.value)
    assert "decoder: its forward takes no cp_context=" in str(model_error.value)
    assert "expected HybridLM or transformers' Qwen3_5ForCausalLM" in str(model_error.value)
    assert "transformers: not one of transformers' Qwen3.5 models" in str(model_error.value)
    error = SoftmaxAttentionContextParallel.error(torch.nn.Linear(2, 2))
    assert error is not None and "decoder: Linear has no project()" in error, error
    with pytest.raises(TypeError, match="transformers: not transformers' Qwen3.5 attention"):
        SoftmaxAttentionContextParallel().install(torch.nn.Linear(2, 2), None)


class _Blocks(torch.nn.Module):
    """A decoder family this library does not know: its blocks under ``stack``."""

    def __init__(self) -> None:
        super().__init__()
        self.stack = HybridLM(TINY_LM).layers


def test_a_family_registered_from_outside_is_found() -> None:
    model = _Blocks()
    with pytest.raises(ValueError, match="no decoder layers to parallelize"):
        adapter_for(model)

    class StackAdapter(DecoderAdapter):
        name = "stack"

        @classmethod
        def declines(cls, model: Any) -> str | None:
            return None if isinstance(model, _Blocks) else "not a _Blocks"

        def decoder(self, model: Any) -> tuple[Any, Any]:
            return None, SimpleNamespace(layers=model.stack)

    register_adapter(StackAdapter)
    try:
        assert type(adapter_for(model)) is StackAdapter
        assert [kind for kind, _ in mixers_of(find_decoder(model)[1])] == [
            kind for kind, _ in mixers_of(HybridLM(TINY_LM))
        ]
    finally:
        ADAPTERS.remove(StackAdapter)


def test_a_modules_family_answers_for_its_layers() -> None:
    ours, theirs = HybridLM(TINY_LM), tiny_model(moe=False)
    for model, adapter, heads in ((ours, DecoderAdapter, (4, 2)), (theirs, TransformersAdapter, (4, 2))):
        mixers = dict(mixers_of(find_decoder(model)[1]))
        assert type(module_adapter_for(model)) is adapter
        for mixer in mixers.values():
            assert type(module_adapter_for(mixer)) is adapter, type(mixer)
        assert module_adapter_for(mixers["self_attn"]).attention_heads(mixers["self_attn"]) == heads
        forward = module_adapter_for(mixers["linear_attn"]).head_sharded_gdn_forward(mixers["linear_attn"])
        assert (forward is None) == (adapter is DecoderAdapter)  # ours reads its weights through LayerWeights
    assert type(module_adapter_for(torch.nn.Linear(2, 2))) is DecoderAdapter  # a module no family claims
    assert module_adapter_for(torch.nn.Linear(2, 2)).attention_heads(torch.nn.Linear(2, 2)) is None
    assert is_silu(theirs.model.layers[0].mlp.act_fn) and is_silu(torch.nn.SiLU())
    assert not is_silu(torch.nn.GELU())
    assert module_adapter_for(ours).inference() is None  # the CP prefill and decoding run ours themselves
    family = module_adapter_for(theirs).inference()
    assert isinstance(family, FamilyInference)
    assert family.decodes(theirs) and not family.decodes(theirs.model)  # the text model has no head
