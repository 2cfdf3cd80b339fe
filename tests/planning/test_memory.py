"""The memory plan's arithmetic against the code it describes: parameter counts against built
models, the activation count against what autograd really saves (a saved-tensor hook on one
decoder block), both at tp = 2 against the tensor-parallel model on 2 gloo ranks, and the longest
sequence against the estimate it is derived from."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from distributed_harness import run_ranks

from hyperpar_gdn.models.lm import DecoderBlock, HybridLM
from hyperpar_gdn.models.qwen35_config import Qwen35Config
from hyperpar_gdn.planning.memory import (
    GIB,
    ModelShape,
    StepOptions,
    estimate,
    largest_rank,
    longest_seq_len,
    mlp_saved_per_token,
    saved_per_token,
)
from hyperpar_gdn.planning.rank_shape import tp_shape
from hyperpar_gdn.train.model_sizes import MODEL_SIZES


@pytest.mark.parametrize("size", ["tiny", "small"])
def test_parameters_match_the_built_model(size: str) -> None:
    model = HybridLM(MODEL_SIZES[size])
    assert ModelShape.of(MODEL_SIZES[size]).num_parameters() == model.num_parameters()


def _qwen35_config(moe: bool, **changes: object) -> object:
    transformers = pytest.importorskip("transformers")
    sizes: dict[str, object] = dict(
        vocab_size=1000,
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        tie_word_embeddings=True,
    )
    sizes.update(changes)
    if moe:
        sizes.update(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=96)
        return transformers.Qwen3_5MoeTextConfig(**sizes, shared_expert_intermediate_size=64)
    return transformers.Qwen3_5TextConfig(**sizes, intermediate_size=384)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_parameters_match_a_transformers_qwen35_model(moe: bool) -> None:
    config = _qwen35_config(moe)
    import transformers

    model = (transformers.Qwen3_5MoeForCausalLM if moe else transformers.Qwen3_5ForCausalLM)(config)
    shape = ModelShape.of(config)
    assert shape.num_parameters() == sum(p.numel() for p in model.parameters())
    assert shape.largest_parameter() == max(p.numel() for p in model.parameters())


def test_a_config_json_is_read_as_the_qwen35_config_reads_it() -> None:
    """The plan's sizes of a config.json are Qwen35Config's (one parser): a multimodal directory's
    text_config, layer_types from the interval; fields only the MindSpore model refuses are read."""
    text = {**_qwen35_config(False).to_dict(), "rope_parameters": {"rope_type": "yarn", "factor": 2.0}}
    text.pop("layer_types")
    with pytest.raises(NotImplementedError, match="rope_type"):
        Qwen35Config.from_dict(text)
    shape = ModelShape.of({"model_type": "qwen3_5", "text_config": text, "tie_word_embeddings": True})
    assert shape.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert shape.vocab_size == 1000 and shape.tie_word_embeddings
    with pytest.raises(ValueError, match="config.json: hidden_size must be a positive int; got 0"):
        ModelShape.of({**text, "hidden_size": 0}, where="config.json")


def test_the_moe_count_matches_what_autograd_saves() -> None:
    """transformers' Qwen3.5-MoE block (routed experts, a shared expert), T=512 fp32: the plan's
    elements per token against the distinct storages a saved-tensor hook sees, within 15%."""
    config = _qwen35_config(True, hidden_size=256)
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    torch.manual_seed(0)
    block = Qwen3_5MoeSparseMoeBlock(config)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.05)
    tokens = 512
    x = torch.randn(1, tokens, config.hidden_size, requires_grad=True)
    measured = _saved_bytes(block, x) - x.numel() * 4  # the input is the norm's, counted there
    lin, f32 = mlp_saved_per_token(ModelShape.of(config))
    assert abs(tokens * 4 * (lin + f32) / measured - 1) < 0.15, (tokens * 4 * (lin + f32), measured)


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def _saved_bytes(block: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves in one forward of ``block`` (its parameters'
    local shards excluded)."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x).sum()
    params = {_local(p).untyped_storage().data_ptr() for p in block.parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in params)


@pytest.mark.parametrize("kind", ["linear_attention", "full_attention"])
def test_saved_per_token_matches_what_autograd_saves(kind: str) -> None:
    """One block of the small preset, T=1024 fp32 on one device: the counted elements per token
    against the distinct storages a saved-tensor hook sees (its input included: the
    plan counts each layer's input with the layer), within 15%."""
    config = MODEL_SIZES["small"]
    torch.manual_seed(0)
    block = DecoderBlock(config, kind)
    tokens = 1024
    x = torch.randn(1, tokens, config.hidden_size, requires_grad=True)
    measured = _saved_bytes(block, x)
    lin, f32 = saved_per_token(ModelShape.of(config), kind, bf16=False, cp=1, packed=False)
    counted = tokens * 4 * (lin + f32)
    if kind == "full_attention":  # K and V of the whole sequence, counted per rank in the plan
        counted += 2 * tokens * config.num_key_value_heads * config.head_dim * 4
    assert abs(counted / measured - 1) < 0.15, (counted, measured)


def _options(**changes: object) -> StepOptions:
    base = StepOptions(seq_len=8192, cp=2, world_size=2, layout="contiguous", runtime_bytes=300 * 2**20)
    return dataclasses.replace(base, **changes)


def test_terms_follow_the_options() -> None:
    shape = ModelShape.of(MODEL_SIZES["small"])
    plain = estimate(shape, _options())
    assert estimate(shape, _options(ac=True)).terms["activations"] < plain.terms["activations"] / 3
    assert estimate(shape, _options(cp=4, world_size=4)).terms["activations"] < plain.terms["activations"]
    fsdp = estimate(shape, _options(fsdp=True))
    assert fsdp.terms["optimizer"] == plain.terms["optimizer"] // 2
    assert fsdp.terms["gradient sync"] < plain.terms["gradient sync"]
    # contiguous shards: the last rank's attention reads every key; head_tail evens them out
    assert estimate(shape, _options(), rank=1).total > estimate(shape, _options(), rank=0).total
    assert largest_rank(shape, _options()).rank == 1
    even = _options(layout="head_tail")
    assert estimate(shape, even, rank=1).total == estimate(shape, even, rank=0).total
    parity = _options(check_parity=True)
    assert largest_rank(shape, parity).rank == 0
    assert estimate(shape, parity, rank=0).terms["parameters"] == 2 * plain.terms["parameters"]


def test_longest_seq_len_is_the_last_that_fits() -> None:
    shape = ModelShape.of(MODEL_SIZES["small"])
    opts = _options(layout="head_tail")
    budget = 2 * GIB
    longest = longest_seq_len(shape, opts, budget)
    assert longest > 0 and longest % 4 == 0
    assert largest_rank(shape, dataclasses.replace(opts, seq_len=longest)).total <= budget
    assert largest_rank(shape, dataclasses.replace(opts, seq_len=longest + 4)).total > budget
    assert longest_seq_len(shape, opts, 2**20) == 0  # not even the runtime fits


def _tp_worker(rank: int, world: int) -> dict[str, tuple[int, int]]:
    """(counted, held) per model at tp = 2: the plan's parameters of one rank against the local
    shards the TP model holds (transformers' dense and MoE with one K/V head, whole at tp 2; the
    small preset with its K/V heads split); then the elements autograd saves for one TP block of
    the small preset (T = 1024 fp32) against the plan's per-token count and weight copies."""
    import transformers

    from hyperpar_gdn import apply_tensor_parallel, init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    out = {}
    for name, config in (("dense", _qwen35_config(False)), ("moe", _qwen35_config(True))):
        cls = transformers.Qwen3_5MoeForCausalLM if name == "moe" else transformers.Qwen3_5ForCausalLM
        model = apply_tensor_parallel(cls(config), mesh["tp"])
        held = sum(_local(p).numel() for p in model.parameters())
        out[name] = (tp_shape(ModelShape.of(config), world).num_parameters(), held)
    small = MODEL_SIZES["small"]
    model = apply_tensor_parallel(HybridLM(small), mesh["tp"])
    local = tp_shape(ModelShape.of(small), world)
    out["small"] = (local.num_parameters(), sum(_local(p).numel() for p in model.parameters()))
    tokens = 1024
    for i, kind in ((0, "linear_attention"), (3, "full_attention")):
        x = torch.randn(1, tokens, small.hidden_size, requires_grad=True)
        lin, f32 = saved_per_token(local, kind, bf16=False, cp=1, packed=False)
        counted = tokens * 4 * (lin + f32) + 4 * local.weight_copies(kind)
        if kind == "full_attention":  # this rank's K/V heads of the whole sequence
            counted += 2 * tokens * local.num_key_value_heads * local.head_dim * 4
        out[kind] = (counted, _saved_bytes(model.layers[i], x))
    return out


def test_tp2_plan_matches_the_tensor_parallel_model() -> None:
    """Parameters exactly; saved activations within 15% (as at tp 1); about half of tp 1's."""
    for rank, counts in enumerate(run_ranks(_tp_worker, 2, timeout_s=120)):
        for name in ("dense", "moe", "small"):
            counted, held = counts[name]
            assert counted == held, f"rank {rank} {name}: plan {counted} parameters, model holds {held}"
        for kind in ("linear_attention", "full_attention"):
            counted, measured = counts[kind]
            assert abs(counted / measured - 1) < 0.15, (rank, kind, counted, measured)
    whole = ModelShape.of(MODEL_SIZES["small"])
    assert 0.49 < tp_shape(whole, 2).num_parameters() / whole.num_parameters() < 0.52


def test_tp_terms_and_refusals() -> None:
    """At tp 2 the matrices, their gradients and optimizer state halve, the loss (whole vocabulary)
    does not; a tp that does not split the heads, or a world it does not fill, is refused."""
    shape = ModelShape.of(MODEL_SIZES["small"])
    one = estimate(shape, _options(cp=1, world_size=1))
    two = estimate(shape, _options(cp=1, tp=2, world_size=2))
    assert two.terms["optimizer"] == 2 * tp_shape(shape, 2).num_parameters() * 4
    assert two.terms["activations"] < 0.7 * one.terms["activations"]
    assert two.terms["loss"] == one.terms["loss"]
    assert two.terms["gradient sync"] < one.terms["parameters"]  # no dp x cp all-reduce at dp = cp = 1
    # (dp 1, cp 2, tp 2): the last CP rank is rank 2
    assert largest_rank(shape, _options(tp=2, world_size=4)).rank == 2
    with pytest.raises(ValueError, match="tp=8 does not split linear_num_key_heads=4"):
        estimate(shape, _options(cp=1, tp=8, world_size=8))
    with pytest.raises(ValueError, match="cp x tp = 2 x 2 must divide world_size=2"):
        _options(tp=2)
