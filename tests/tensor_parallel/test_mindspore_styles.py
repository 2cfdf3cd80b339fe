"""Tensor parallelism on MindSpore (MCCL on CPU, msrun with 4 workers, a (cp, tp) = (2, 2) mesh,
tp innermost): the MindSpore GDN layer and ``CausalSelfAttention`` split by heads over tp
(:mod:`hyperpar_gdn.tensor_parallel.mindspore_styles`), with context parallelism over cp in every
one-level GDN mode, both layouts and packed documents, and at tp = 2 alone, equal the same layer on
one device (float32): output, input gradient and every parameter gradient; the TP parts of the
weights put back together are the one-device weights. A whole MindSpore Qwen3.5 model (dense and
MoE) under ``apply_tensor_parallel`` and ``apply_context_parallel`` (p2p, head_tail): logits and
every gradient equal one device. Wrong set-ups: one ValueError on every rank, the cell (or the model)
left as it was. The sections run in the shared 4-worker msrun job
(``msrun_harness.cp_worker_job(4)``, ``tests/distributed/msrun_tp_sections.py``)."""

from __future__ import annotations

import pytest

pytest.importorskip("mindspore")

import msrun_tp_sections as sections  # noqa: E402
from msrun_harness import GDN_PARAMS, cp_worker_job, section_data  # noqa: E402

# docs/maths.md: fp32 max abs error <= 1e-4 relative to each tensor's scale (measured worst here:
# 1.4e-5, A_log's gradient under ulysses_hidden)
TOL = 1e-4
WORLD = 4
ATTENTION_PARAMS = {f"{p}_proj.weight" for p in "qkvo"} | {"q_norm.weight", "k_norm.weight"}
# parameter -> (dim split over tp, or None: whole on every rank)
GDN_SPLIT = {"in_proj_qkv.weight": 0, "conv1d.weight": 0, "in_proj_z.weight": 0, "in_proj_b.weight": 0,
             "in_proj_a.weight": 0, "A_log": 0, "dt_bias": 0, "out_proj.weight": 1, "norm.weight": None}  # fmt: skip


def _split(key: str) -> dict[str, int | None]:
    if key.startswith("gdn/"):
        return GDN_SPLIT
    kv_whole = key.startswith("attention/kv1/")  # tp 2 is a multiple of 1 K/V head
    kv = None if kv_whole else 0
    return {"q_proj.weight": 0, "o_proj.weight": 1, "k_proj.weight": kv, "v_proj.weight": kv,
            "q_norm.weight": None, "k_norm.weight": None}  # fmt: skip


@pytest.mark.timeout(600)  # the first test to ask for the shared job waits for all its sections
def test_gdn_and_attention_at_tp2_cp2_equal_one_device() -> None:
    per_rank = section_data(cp_worker_job(WORLD), "tp_layers")
    expected_keys = {
        f"gdn/{m or 'tp_only'}/{lay}{'/packed' if p else ''}" for m, lay, p in sections.GDN_CASES
    }
    expected_keys |= {
        f"attention/kv{kv}/{lay or 'tp_only'}{'/packed' if p else ''}"
        for kv, lay, p in sections.ATTENTION_CASES
    }
    for rank, results in enumerate(per_rank):
        tp_rank, cp_rank = rank % 2, rank // 2
        assert results.pop("cp_ranks") == [tp_rank, tp_rank + 2], f"rank {rank}: cp group not strided by tp"
        assert results.pop("tp_ranks") == [2 * cp_rank, 2 * cp_rank + 1], f"rank {rank}: tp group"
        assert set(results) == expected_keys, sorted(set(results) ^ expected_keys)
        for key, case in results.items():
            params = set(GDN_PARAMS) if key.startswith("gdn/") else ATTENTION_PARAMS
            assert set(case["errors"]) == {"output", "dx"} | params, (key, sorted(case["errors"]))
            bad = {k: v for k, v in case["errors"].items() if not v <= TOL}
            assert not bad, f"rank {rank} {key}: {bad}"
            assert case["weights"] == dict.fromkeys(params, 0.0), f"rank {rank} {key}: {case['weights']}"
            shard = case["shard"]  # the cell's HeadShard: the rank's heads of the whole layer
            kv = 1 if key.startswith("attention/kv1/") else 2
            kind, sizes = ("gdn", [2, 16, 4, 8]) if key.startswith("gdn/") else ("attention", [4, kv])
            assert shard.pop("whole_has_none"), f"rank {rank} {key}: the one-device cell has a HeadShard"
            expected = {"kind": kind, "size": 2, "rank": tp_rank, "sizes": sizes, "heads": 0.0}
            assert shard == expected, f"rank {rank} {key}: {shard}"
            if "tp_only" in key:  # docs/tensor_parallel.md, bytes per rank: the block's output and
                # its input's gradient (B T C each) and the gradients of the weights held whole (the
                # gated norm's Dv = 8; q_norm and k_norm, D = 8 each), 4 bytes, to tp - 1 = 1 rank
                whole = 8 if key.startswith("gdn/") else 2 * 8
                assert case["bytes_sent"] == (2 * sections.T * sections.HIDDEN + whole) * 4, (key, case)
            for name, dim in _split(key).items():
                whole, local = case["whole_shapes"][name], case["local_shapes"][name]
                if dim is not None:
                    whole[dim] //= 2
                assert local == whole, (
                    f"rank {rank} {key} {name}: local {local}, whole {case['whole_shapes'][name]}"
                )


@pytest.mark.timeout(600)
def test_wrong_set_ups_raise_one_value_error_on_every_rank() -> None:
    per_rank = section_data(cp_worker_job(WORLD), "tp_bad_input")
    expected = {
        "gdn_k_heads": "GatedDeltaNet at tp=2: num_k_heads=1 is not divisible by tp=2",
        "attention_heads": "CausalSelfAttention at tp=2: self_attn: num_attention_heads=3 is not divisible by tp=2",
        "attention_kv_heads": "CausalSelfAttention at tp=2: self_attn: num_key_value_heads=3 and tp=2",
        "after_cp": "GatedDeltaNet at tp=2: context parallelism is applied: apply tensor parallelism first",
        "twice": "GatedDeltaNet at tp=2: tensor parallelism is already applied",
        "not_1d": "tensor parallelism needs a 1-D mesh; got shape (2, 2)",
        "ulysses_tp_x_cp": "layer 0: mode='ulysses' splits each TP rank's value heads over the CP ranks: "
        "num_v_heads=2 is not divisible by tp x cp = 2 x 2",
    }
    for rank, outcomes in enumerate(per_rank):
        assert outcomes.pop("in_step") == list(range(WORLD)), f"rank {rank}: ranks out of step"
        assert set(outcomes) == set(expected), sorted(outcomes)
        for check, (kind, message, unchanged) in outcomes.items():
            assert kind == "ValueError" and message.startswith(expected[check]), (
                f"rank {rank} {check}: {message}"
            )
            # the cells of the TP checks are left as they were (twice: as the first apply left it)
            assert unchanged, f"rank {rank} {check}: the cell's parameters changed"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_whole_qwen35_model_at_tp2_cp2_equals_one_device(kind: str) -> None:
    # the logits and the model's parameters: dense 28; MoE, each block's 3 MLP matrices replaced by
    # 17 (4 experts and a shared expert of 3 matrices each, the router, the shared expert's gate)
    count = {"dense": 1 + 28, "moe": 1 + 28 + 2 * (17 - 3)}[kind]
    for rank, results in enumerate(section_data(cp_worker_job(WORLD), "tp_model")):
        errors = results[kind]
        assert len(errors) == count, sorted(errors)
        assert "logits" in errors and "model.layers.0.linear_attn.in_proj_qkv.weight" in errors, sorted(
            errors
        )
        assert "lm_head.weight" in errors, sorted(errors)
        bad = {k: v for k, v in errors.items() if not v <= TOL}
        assert not bad, f"rank {rank} {kind}: {bad}"
        kind_, message = results["refusal"]
        assert kind_ == "ValueError", message
        assert message.startswith("layer 1: CausalSelfAttention at tp=2: self_attn: num_attention_heads=3"), (
            message
        )
        assert results["qkv_shape_after_refusal"] == [64, 32], "the refused model's GDN layer was split"
