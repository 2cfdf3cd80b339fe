"""Decoding for HybridLM (torch): the state after a prompt and each greedy step equal the model
run whole over the longer sequence (fp64), and the GDN decoding step equals transformers' cached
step of ``Qwen3_5GatedDeltaNet`` (the same weights)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import gdn_layer_config, move_off_init

from hyperpar_gdn.inference.decoding import decode_step, greedy_continue, greedy_generate, prefill
from hyperpar_gdn.models import HybridLM, HybridLMConfig
from hyperpar_gdn.ops.gdn.decode import gdn_decode_step
from hyperpar_gdn.ops.gdn.layer import LayerDims, LayerWeights
from hyperpar_gdn.platform import ops_for

TOL = 1e-10


def tiny_lm() -> HybridLM:
    torch.manual_seed(0)
    model = HybridLM(HybridLMConfig(num_layers=4, vocab_size=61, initializer_range=0.3)).double()
    return model.eval()


def test_steps_equal_the_whole_sequence() -> None:
    model = tiny_lm()
    ids = torch.randint(0, 61, (2, 13), generator=torch.Generator().manual_seed(1))
    logits, state = prefill(model, ids[:, :9])
    with torch.no_grad():
        whole = model(ids)
    assert state.length == 9
    assert (logits - whole[:, 8]).abs().max() / whole.abs().max() < TOL
    for t in range(9, 13):
        logits, state = decode_step(model, state, ids[:, t : t + 1])
        err = ((logits - whole[:, t]).abs().max() / whole.abs().max()).item()
        assert err < TOL, f"step at position {t}: relative error {err:.1e}"
    _, longer = prefill(model, ids)  # the state after the steps is that of the longer prompt
    for i, ((a1, b1), (a2, b2)) in enumerate(zip(state.layers, longer.layers, strict=True)):
        for got, ref in ((a1, a2), (b1, b2)):
            assert got.shape == ref.shape, f"layer {i}: {tuple(got.shape)} != {tuple(ref.shape)}"
            assert (got - ref).abs().max() <= TOL * ref.abs().max(), f"layer {i}"


def test_greedy_generate_equals_argmax_of_whole_forwards() -> None:
    model = tiny_lm()
    ids = torch.randint(0, 61, (2, 7), generator=torch.Generator().manual_seed(2))
    out = greedy_generate(model, ids, max_new_tokens=16)
    ref = ids
    with torch.no_grad():
        for _ in range(16):
            ref = torch.cat([ref, model(ref)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, ref)
    assert len(set(out[0, 7:].tolist())) > 1, "a constant continuation would not test the steps"


def test_prompt_shorter_than_the_conv() -> None:
    model = tiny_lm()
    ids = torch.randint(0, 61, (1, 6), generator=torch.Generator().manual_seed(3))
    logits, state = prefill(model, ids[:, :2])  # 2 tokens < W = 4: zeros in front of the conv state
    with torch.no_grad():
        whole = model(ids)
    for t in range(2, 6):
        logits, state = decode_step(model, state, ids[:, t : t + 1])
        assert (logits - whole[:, t]).abs().max() <= TOL * whole.abs().max()


def test_gdn_step_equals_transformers_cached_step() -> None:
    transformers = pytest.importorskip("transformers")
    config = gdn_layer_config(key_head_dim=8)
    torch.manual_seed(0)
    layer = transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5GatedDeltaNet(config, 0).double().eval()
    move_off_init(layer, 0.2)
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    cache = transformers.DynamicCache(config=config)
    with torch.no_grad():
        layer(x[:, :8], cache=cache)  # transformers' prefill fills the cache
        conv = cache.layers[0].conv_states[0].clone()
        state = cache.layers[0].recurrent_states[0].clone()
        ref = layer(x[:, 8:], cache=cache)  # its cached step
        xp = ops_for(x)
        out, conv_new, state_new = gdn_decode_step(
            xp, LayerWeights.of(layer), LayerDims.of(layer), x[:, 8:], conv, state
        )
    # transformers runs the rule in fp32: fp32 rounding
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert torch.equal(conv_new, cache.layers[0].conv_states[0])
    assert (state_new - cache.layers[0].recurrent_states[0]).abs().max() <= 1e-5 * state_new.abs().max()


def test_refuses_bad_input() -> None:
    model = tiny_lm()
    logits, state = prefill(model, torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"one token per row, \[B, 1\]; got shape \(1, 2\)"):
        decode_step(model, state, torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int; got 0"):
        greedy_continue(model, logits, state, max_new_tokens=0)
    with pytest.raises(ValueError, match=r"input_ids \[B, T\] with T >= 1; got shape \(5,\)"):
        prefill(model, torch.zeros(5, dtype=torch.long))
