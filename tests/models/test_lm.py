"""The hybrid LM and its softmax attention on one device: layout, causality, RoPE offsets, the tied
head, and the config's checks."""

from __future__ import annotations

import pytest
import torch
from tiny_models import TINY_LM

from hyperpar_gdn.models.attention import CausalSelfAttention
from hyperpar_gdn.models.lm import FULL, LINEAR, HybridLM, HybridLMConfig


def test_three_of_four_blocks_are_gdn() -> None:
    config = HybridLMConfig(num_layers=8)
    assert config.layer_types == (LINEAR, LINEAR, LINEAR, FULL) * 2
    model = HybridLM(config)
    kinds = [type(block.mixer).__name__ for block in model.layers]
    assert kinds == ["GatedDeltaNet"] * 3 + ["CausalSelfAttention"] + ["GatedDeltaNet"] * 3 + [
        "CausalSelfAttention"
    ]


def test_lm_head_is_tied_to_the_embedding() -> None:
    torch.manual_seed(0)
    model = HybridLM(TINY_LM)
    names = set(model.state_dict())
    assert not any("lm_head" in name for name in names)
    ids = torch.randint(0, 256, (2, 12))
    logits = model(ids)
    assert logits.shape == (2, 12, 256) and logits.dtype == torch.float32
    with torch.no_grad():
        model.embed_tokens.weight[7] += 1.0  # row 7 feeds the logit of token 7 at every position
    changed = model(ids) - logits
    assert changed[..., 7].abs().min() > 0


@pytest.mark.parametrize("position", [0, 9, 20])
def test_lm_is_causal(position: int) -> None:
    torch.manual_seed(0)
    model = HybridLM(TINY_LM)
    ids = torch.randint(0, 256, (2, 21))
    other = ids.clone()
    other[:, position] = (other[:, position] + 1) % 256
    with torch.no_grad():
        a, b = model(ids), model(other)
    torch.testing.assert_close(a[:, :position], b[:, :position], rtol=0, atol=1e-6)
    assert (a[:, position] - b[:, position]).abs().max() > 1e-4


def test_attention_with_offset_equals_rows_of_the_full_sequence() -> None:
    """Queries of tokens [8, 16) at position offset 8 over keys [0, 16) are rows 8..15 of the
    whole-sequence forward: what the CP style relies on."""
    torch.manual_seed(0)
    attn = CausalSelfAttention(32, num_heads=4, num_kv_heads=2, head_dim=8)
    x = torch.randn(2, 24, 32)
    full = attn(x)
    _, k, v, _ = attn.project(x[:, :16])
    q, _, _, gate = attn.project(x[:, 8:16], position_offset=8)
    rows = attn.finish(attn.attend(q, k, v, q_offset=8), gate)
    torch.testing.assert_close(rows, full[:, 8:16], rtol=1e-5, atol=1e-6)
    without_offset = attn.project(x[:, 8:16])[0]
    assert (without_offset - q).abs().max() > 1e-3  # RoPE really depends on the offset


def test_attention_rejects_queries_beyond_the_keys() -> None:
    attn = CausalSelfAttention(16, num_heads=2, num_kv_heads=2, head_dim=8)
    q, k, v, _ = attn.project(torch.randn(1, 4, 16))
    with pytest.raises(ValueError, match=r"positions \[2, 6\).*Tk=4"):
        attn.attend(q, k, v, q_offset=2)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_key_value_heads", 3, "num_attention_heads=4 must be a multiple of num_key_value_heads=3"),
        ("linear_num_key_heads", 3, "linear_num_value_heads=4 must be a multiple of linear_num_key_heads=3"),
        ("head_dim", 7, "head_dim=7 must be even"),
        ("num_layers", 0, "num_layers must be a positive int; got 0"),
    ],
)
def test_config_errors_name_the_field(field: str, value: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HybridLMConfig(**{field: value})


def test_config_is_keyword_only() -> None:
    with pytest.raises(TypeError):
        HybridLMConfig(256)  # type: ignore[misc]
