"""The tensor-parallel record of a block (:mod:`hyperpar_gdn.ops.head_shard`): on torch (2 gloo
ranks) every block of a TP-split HybridLM and of transformers' MoE Qwen3.5 carries one
:class:`HeadShard` whose sizes are the whole block's and whose weights are the rank's heads of the
whole layer; a whole block carries none. MindSpore's cells: tests/tensor_parallel/test_mindspore_styles.py."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from distributed_harness import run_ranks
from tiny_models import tiny_model

from hyperpar_gdn import apply_tensor_parallel, init_device_mesh
from hyperpar_gdn.distributed.decoder_layers import mixer_of, text_model_of
from hyperpar_gdn.models.lm import HybridLM, HybridLMConfig
from hyperpar_gdn.ops.gdn.layer import LayerDims
from hyperpar_gdn.ops.head_shard import HeadShard, head_shard_of, set_head_shard


def _shard(**overrides: Any) -> HeadShard:
    fields: dict[str, Any] = {
        "kind": "gdn",
        "size": 2,
        "rank": 1,
        "group": None,
        "sizes": (2, 8, 4, 8),
        "reduce": lambda x: x,
    }
    return HeadShard(**{**fields, **overrides})


def test_a_record_names_its_rank_heads_and_is_set_once() -> None:
    shard = _shard()
    assert shard.owned(4) == range(2, 4)
    assert _shard(size=4, rank=0).owned(8) == range(0, 2)
    with pytest.raises(ValueError, match=r"6 heads or columns do not split evenly over size=4"):
        _shard(size=4, rank=0).owned(6)
    with pytest.raises(ValueError, match=r"kind='mixer' is not one of"):
        _shard(kind="mixer")
    with pytest.raises(ValueError, match=r"rank=2 is not a rank of a TP group of size=2"):
        _shard(rank=2)
    module = torch.nn.Linear(2, 2)
    assert head_shard_of(module) is None
    set_head_shard(module, shard)
    assert head_shard_of(module) is shard
    with pytest.raises(ValueError, match=r"Linear already has tensor parallelism applied"):
        set_head_shard(module, _shard(rank=0))


def _hybrid() -> torch.nn.Module:
    torch.manual_seed(0)
    return HybridLM(
        HybridLMConfig(vocab_size=61, hidden_size=32, num_layers=4, linear_num_key_heads=2)
    ).double()


def _records(model: torch.nn.Module, world: int) -> list[dict[str, Any]]:
    """What each block's record says of a TP copy of ``model``, checked against the whole layer."""
    whole_layers = text_model_of(model).layers
    split = apply_tensor_parallel(
        copy.deepcopy(model), init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    )
    found = []
    for i, (block, whole_block) in enumerate(zip(text_model_of(split).layers, whole_layers, strict=True)):
        kind, mixer = mixer_of(i, block)
        whole = getattr(whole_block, kind)
        shard, mlp = head_shard_of(mixer), head_shard_of(block.mlp)
        record: dict[str, Any] = {
            "whole": head_shard_of(whole) is None and head_shard_of(whole_block.mlp) is None,
            "norm": head_shard_of(block.input_layernorm) is None,
            "kind": shard.kind,
            "size": shard.size,
            "rank": shard.rank,
            "sizes": shard.sizes,
            "mlp": (mlp.kind, mlp.sizes, mlp.rank),
            "sum": shard.reduce(torch.full((1, 1, 2), float(shard.rank + 1), dtype=torch.float64)).tolist(),
        }
        if kind == "linear_attn":
            dims, local = LayerDims.of(whole), LayerDims.of(mixer)
            heads = list(shard.owned(dims.num_v_heads))
            weights = shard.weights()
            record["dims"] = (dims.num_k_heads, dims.head_k_dim, dims.num_v_heads, dims.head_v_dim)
            record["local"] = (local.tp, local.num_k_heads, local.num_v_heads)
            record["a_log"] = torch.equal(weights.a_log, whole.A_log[heads])
            record["dt_bias"] = torch.equal(weights.dt_bias, whole.dt_bias[heads])
        else:
            record["dims"] = (whole.num_heads, whole.num_kv_heads) if hasattr(whole, "num_kv_heads") else None
        found.append(record)
    return found


def _worker(rank: int, world: int) -> dict[str, list[dict[str, Any]]]:
    return {"hybrid": _records(_hybrid(), world), "moe": _records(tiny_model(moe=True), world)}


def test_a_tp_split_layer_records_its_ranks_heads() -> None:
    world = 2
    for rank, by_model in enumerate(run_ranks(_worker, world, timeout_s=300)):
        for name, records in by_model.items():
            kinds = [r["kind"] for r in records]
            assert kinds == ["gdn", "gdn", "gdn", "attention"], (name, kinds)
            for i, r in enumerate(records):
                where = f"rank {rank} {name} layer {i}"
                assert r["whole"] and r["norm"], f"{where}: a whole block or a norm has a record"
                assert (r["size"], r["rank"]) == (world, rank), where
                assert r["sum"] == [[[3.0, 3.0]]], f"{where}: reduce gave {r['sum']}"
                mlp_kind, mlp_sizes, mlp_rank = r["mlp"]
                assert (mlp_kind, mlp_rank) == ("moe" if name == "moe" else "mlp", rank), where
                assert len(mlp_sizes) == 1 and mlp_sizes[0] > 0, where
                if r["kind"] == "gdn":
                    assert r["sizes"] == r["dims"], f"{where}: {r['sizes']} != whole {r['dims']}"
                    hk, hv = r["dims"][0] // world, r["dims"][2] // world
                    assert r["local"] == (world, hk, hv), f"{where}: LayerDims {r['local']}"
                    assert r["a_log"] and r["dt_bias"], f"{where}: weights are not the rank's heads"
                else:
                    assert len(r["sizes"]) == 2, where
                    if r["dims"] is not None:  # ours; transformers' read from its config
                        assert r["sizes"] == r["dims"], where
