"""The rules of tensor parallelism: the block a torch rank shards out of the grouped (or
interleaved) order, put back in local order, is exactly the rows MindSpore's rank cuts; every
parameter's indices are split over the ranks without a gap or an overlap."""

from __future__ import annotations

import numpy as np
import pytest

from hyperpar_gdn.ops.gdn.layer import LayerDims
from hyperpar_gdn.planning.tp_rules import (
    attention_head_error,
    attention_parts,
    block,
    gate_up_interleaved_order,
    gate_up_local_order,
    gdn_parts,
    kv_head_of,
    kv_heads_per_rank,
    mlp_parts,
    qkv_grouped_order,
    qkv_local_order,
    tensor_parallel_head_error,
)

# (num_k_heads, head_k_dim, num_v_heads, head_v_dim, tp)
GDN_SHAPES = [(2, 4, 4, 3, 2), (4, 2, 8, 5, 2), (4, 2, 8, 5, 4), (6, 3, 6, 2, 3), (16, 8, 48, 8, 8)]


def _dims(hk: int, dk: int, hv: int, dv: int) -> LayerDims:
    return LayerDims(
        hidden_size=7, num_k_heads=hk, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv, conv_kernel_size=4,
        norm_eps=1e-6,
    )  # fmt: skip


def _covers(pieces: list[np.ndarray], size: int) -> bool:
    joined = np.concatenate(pieces)
    return len(joined) == size and np.array_equal(np.sort(joined), np.arange(size))


@pytest.mark.parametrize(("hk", "dk", "hv", "dv", "tp"), GDN_SHAPES)
def test_a_torch_shard_of_the_grouped_rows_is_the_ranks_heads(
    hk: int, dk: int, hv: int, dv: int, tp: int
) -> None:
    dims = _dims(hk, dk, hv, dv)
    grouped = qkv_grouped_order(hk, dk, hv, dv)
    assert _covers([grouped], dims.conv_dim)
    parts = [gdn_parts(dims, tp, t) for t in range(tp)]
    for t, part in enumerate(parts):
        dim, rows = part["in_proj_qkv.weight"]
        assert dim == 0 and np.array_equal(block(grouped, tp, t)[qkv_local_order(dims, tp)], rows), t
        # [q | k | v] of the rank's heads: q/k heads t hk/tp.., value heads t hv/tp..
        q, v = rows[: 2 * (hk // tp) * dk], rows[2 * (hk // tp) * dk :]
        assert set(q // dk % hk) == set(range(t * hk // tp, (t + 1) * hk // tp))
        assert set((v - 2 * dims.key_dim) // dv) == set(range(t * hv // tp, (t + 1) * hv // tp))
    sizes = {"in_proj_qkv.weight": dims.conv_dim, "in_proj_z.weight": dims.value_dim, "A_log": hv}
    sizes |= {"out_proj.weight": dims.value_dim, "in_proj_a.weight": hv, "dt_bias": hv}
    for name, size in sizes.items():
        assert _covers([p[name][1] for p in parts], size), name
    assert parts[0]["out_proj.weight"][0] == 1


@pytest.mark.parametrize(("intermediate", "tp"), [(6, 2), (12, 3), (8, 4)])
def test_the_experts_interleaved_shard_is_the_mlp_columns(intermediate: int, tp: int) -> None:
    interleaved = gate_up_interleaved_order(intermediate)
    for t in range(tp):
        cols = mlp_parts(intermediate, tp, t)["gate_proj.weight"][1]
        local = block(interleaved, tp, t)[gate_up_local_order(intermediate, tp)]
        assert np.array_equal(local, np.concatenate([cols, intermediate + cols])), t
    pieces = [mlp_parts(intermediate, tp, t) for t in range(tp)]
    for name in ("gate_proj.weight", "up_proj.weight", "down_proj.weight"):
        assert _covers([p[name][1] for p in pieces], intermediate), name


@pytest.mark.parametrize(("heads", "kv_heads", "tp"), [(4, 2, 2), (8, 2, 4), (4, 1, 4), (8, 4, 4)])
def test_attention_heads_and_the_kv_head_each_rank_uses(heads: int, kv_heads: int, tp: int) -> None:
    d = 3
    parts = [attention_parts(heads, kv_heads, d, tp, t) for t in range(tp)]
    assert _covers([p["q_proj.weight"][1] for p in parts], 2 * heads * d)
    assert _covers([p["o_proj.weight"][1] for p in parts], heads * d)
    if kv_heads % tp == 0:
        assert _covers([p["k_proj.weight"][1] for p in parts], kv_heads * d)
        assert [kv_head_of(t, kv_heads, tp) for t in range(tp)] == [None] * tp
        assert kv_heads_per_rank(kv_heads, tp) == kv_heads // tp
    else:  # whole on every rank; rank t's query heads belong to K/V head kv_head_of(t)
        assert all("k_proj.weight" not in p for p in parts)
        group = heads // kv_heads  # query heads per K/V head
        for t in range(tp):
            first_query = t * heads // tp
            assert kv_head_of(t, kv_heads, tp) == first_query // group, t
        assert kv_heads_per_rank(kv_heads, tp) == 1


def test_layers_that_do_not_split_are_named() -> None:
    assert "num_k_heads=6 is not divisible by tp=4" in tensor_parallel_head_error(_dims(6, 2, 12, 2), 4)
    assert tensor_parallel_head_error(_dims(4, 2, 8, 2), 2) is None
    error = tensor_parallel_head_error(_dims(4, 2, 8, 2), 2, cp=8, mode="ulysses")
    assert "num_v_heads=8 is not divisible by tp x cp = 2 x 8" in error
    assert attention_head_error(6, 2, 4) == "self_attn: num_attention_heads=6 is not divisible by tp=4"
    assert "num_key_value_heads=3 and tp=2" in attention_head_error(6, 3, 2)
    assert attention_head_error(8, 2, 4) is None
