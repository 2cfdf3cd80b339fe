"""The per-forward context travels explicitly: HybridLM passes it to every mixer as ``cp_context=``;
a transformers model's hook leaves it in the holder and the layers get no mask in disguise
(real gloo ranks, cp=2)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from distributed_harness import run_ranks
from tiny_models import tiny_model

from hyperpar_gdn import apply_context_parallel, init_device_mesh, shard_for_context_parallel
from hyperpar_gdn.distributed.decoder_layers import mixers_of
from hyperpar_gdn.distributed.sequence import GlobalSequence
from hyperpar_gdn.models import HybridLM, HybridLMConfig

T = 16
CU = torch.tensor([0, 5, 12, 16])  # a document across the shard boundary at 8


def _record(module: Any, seen: list[dict[str, Any]]) -> None:
    installed = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        seen.append({k: v for k, v in kwargs.items() if v is not None})
        return installed(*args, **kwargs)

    module.forward = forward


def _worker(rank: int, world: int) -> dict[str, object]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    ids = torch.randint(0, 61, (1, T), generator=torch.Generator().manual_seed(0))
    out: dict[str, object] = {}

    torch.manual_seed(0)
    hybrid = HybridLM(HybridLMConfig(vocab_size=61, hidden_size=32, num_layers=4)).double()
    apply_context_parallel(hybrid, mesh, mode="p2p")
    seen: list[dict[str, Any]] = []
    for _, module in mixers_of(hybrid):
        _record(module, seen)
    window = slice(rank * T // world, (rank + 1) * T // world)
    hybrid(ids[:, window], cu_seqlens=CU)
    contexts = [s.get("cp_context") for s in seen]
    out["hybrid keywords"] = sorted({k for s in seen for k in s})
    out["hybrid one context"] = isinstance(contexts[0], GlobalSequence) and all(
        c is contexts[0] for c in contexts
    )
    out["hybrid documents"] = contexts[0].cu_seqlens.tolist()
    try:  # the context in disguise is refused
        mixers_of(hybrid)[0][1](torch.zeros(1, T // world, 32, dtype=torch.float64), cu_seqlens=contexts[0])
    except TypeError as err:
        out["disguised"] = str(err)

    hf = apply_context_parallel(tiny_model(moe=False), mesh, mode="p2p")
    seen = []
    for _, module in mixers_of(hf.model):
        _record(module, seen)
    hf(**shard_for_context_parallel(mesh, ids).model_inputs())
    out["transformers masks"] = sorted({type(s.get("attention_mask")).__name__ for s in seen})
    out["transformers layers"] = len(seen)
    return out


@pytest.mark.timeout(120)
def test_the_context_is_passed_explicitly() -> None:
    for out in run_ranks(_worker, 2, timeout_s=90):
        assert out["hybrid keywords"] == ["cp_context"], out
        assert out["hybrid one context"] and out["hybrid documents"] == CU.tolist(), out
        assert "cp_context=" in out["disguised"], out
        assert out["transformers masks"] == ["NoneType"], out
        assert out["transformers layers"] == 4, out
