"""The per-forward context travels explicitly, as ``cp_context=``: HybridLM passes it to every
mixer, a transformers model's hook adds it to the keywords its decoder layers pass on, and the
layers get no mask in disguise; a mixer called alone describes its own call, whatever forward ran
before (real gloo ranks, cp=2)."""

from __future__ import annotations

import contextlib
import copy
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from distributed_harness import run_ranks
from tiny_models import tiny_model

from hyperpar_gdn import apply_context_parallel, init_device_mesh, shard_for_context_parallel
from hyperpar_gdn.distributed import sequence
from hyperpar_gdn.distributed.decoder_layers import mixers_of, text_model_of
from hyperpar_gdn.distributed.sequence import GlobalSequence
from hyperpar_gdn.models import HybridLM, HybridLMConfig
from hyperpar_gdn.ops.gdn import varlen

T = 16
CU = torch.tensor([0, 5, 12, 16])  # a document across the shard boundary at 8


def _record(module: Any, seen: list[dict[str, Any]]) -> None:
    installed = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        seen.append({k: v for k, v in kwargs.items() if v is not None})
        return installed(*args, **kwargs)

    module.forward = forward


@contextlib.contextmanager
def _counting() -> Iterator[Counter[str]]:
    """Count, while it is open, the packed documents' host work: the Documents made (a view of the
    documents for the spans the GDN layers run on), their checks (of cu_seqlens or doc_starts) and
    the host builds of the conv's and the chunked rule's masks."""
    counts: Counter[str] = Counter()
    watched = {
        "documents": (varlen.Documents, "__init__"),
        "checks": (varlen, "check_doc_starts"),
        "cu checks": (sequence, "check_cu_seqlens"),  # GlobalSequence.build's
        "conv masks": (varlen, "conv_tap_masks"),
        "chunk masks": (varlen, "chunk_mask_arrays"),
    }
    originals = {name: getattr(owner, attr) for name, (owner, attr) in watched.items()}

    def counted(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return originals[name](*args, **kwargs)

        return call

    for name, (owner, attr) in watched.items():
        setattr(owner, attr, counted(name))
    try:
        yield counts
    finally:
        for name, (owner, attr) in watched.items():
            setattr(owner, attr, originals[name])


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
    with _counting() as counts:
        hybrid(ids[:, window], cu_seqlens=CU)
    out["hybrid document views"] = counts["documents"]
    out["hybrid gdn layers"] = sum(kind == "linear_attn" for kind, _ in mixers_of(hybrid))
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

    hf = tiny_model(moe=False)
    reference = copy.deepcopy(hf)
    apply_context_parallel(hf, mesh, mode="p2p")
    seen = []
    for _, module in mixers_of(hf.model):
        _record(module, seen)
    hf(**shard_for_context_parallel(mesh, ids, cu_seqlens=CU).model_inputs())
    contexts = [s.get("cp_context") for s in seen]
    out["transformers masks"] = sorted({type(s.get("attention_mask")).__name__ for s in seen})
    out["transformers layers"] = len(seen)
    out["transformers one context"] = isinstance(contexts[0], GlobalSequence) and all(
        c is contexts[0] for c in contexts
    )
    out["transformers documents"] = contexts[0].cu_seqlens.tolist()

    # After that packed forward, each mixer called alone sees its own call only (no documents):
    # the rows of the single-device layer on the whole sequence, for the GDN and the attention alike.
    x = torch.randn(1, T, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    rotary = text_model_of(reference).rotary_emb
    cos_sin = rotary(x, torch.arange(T).reshape(1, T))
    for (kind, layer), (_, whole) in zip(mixers_of(hf.model), mixers_of(reference.model), strict=True):
        if kind == "linear_attn":
            mine, expected = layer(x[:, window]), whole(x)
        else:
            mine = layer(x[:, window], tuple(c[:, window] for c in cos_sin))[0]
            expected = whole(x, cos_sin, attention_mask=None)[0]
        out.setdefault("alone", []).append((kind, float((mine - expected[:, window]).abs().max())))
    return out


@pytest.mark.timeout(300)
def test_the_context_is_passed_explicitly() -> None:
    for out in run_ranks(_worker, 2, timeout_s=240):
        assert out["hybrid keywords"] == ["cp_context"], out
        assert out["hybrid one context"] and out["hybrid documents"] == CU.tolist(), out
        # the shard's documents are computed once per forward, not once per GDN layer
        assert out["hybrid gdn layers"] >= 2 and out["hybrid document views"] == 1, out
        assert "cp_context=" in out["disguised"], out
        assert out["transformers masks"] == ["NoneType"], out
        assert out["transformers layers"] == 4, out
        assert out["transformers one context"] and out["transformers documents"] == CU.tolist(), out
        assert sorted({kind for kind, _ in out["alone"]}) == ["linear_attn", "self_attn"], out
        # transformers' GDN layer computes its gates in float32 (~1e-8 here); a document boundary
        # read from the forward before would change the rows by far more
        assert all(err < 1e-6 for _, err in out["alone"]), out["alone"]


def test_a_context_rebuilt_to_cast_its_tensors_shares_its_memo() -> None:
    """FSDP2's mixed precision rebuilds a dataclass argument with ``dataclasses.replace`` to cast its
    tensors before each wrapped block: the copy must build, cast, and share the forward's memo (the
    documents cut once, the device masks copied once)."""
    import dataclasses

    seq = GlobalSequence.build(
        [6, 6], rank=1, cu_seqlens=[0, 5, 12], key_mask=torch.ones(1, 12), host_key_mask=torch.ones(1, 12)
    )
    cast = dataclasses.replace(seq, key_mask=seq.key_mask.to(torch.bfloat16))
    docs = cast.shard_docs(4, by_fragment=False)
    assert cast.key_mask.dtype == torch.bfloat16 and seq.memo is cast.memo
    assert seq.shard_docs(4, by_fragment=False) is docs


def _work_per_forward(rank: int, world: int, plan: dict[str, Any], gdn_layers: int) -> dict[str, int]:
    """The packed documents' host work in the second forward of a HybridLM of ``gdn_layers`` GDN
    layers and one attention layer (the first forward is left out: it compiles nothing here, but
    makes its own context like any other)."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    n = gdn_layers + 1
    hybrid = HybridLM(HybridLMConfig(vocab_size=61, hidden_size=32, num_layers=n, full_attention_interval=n))
    hybrid = hybrid.double()
    apply_context_parallel(hybrid, mesh, **plan)
    ids = torch.randint(0, 61, (1, T), generator=torch.Generator().manual_seed(0))
    batch = shard_for_context_parallel(mesh, ids, cu_seqlens=CU, layout=plan.get("layout", "contiguous"))
    x = batch.model_inputs()["input_ids"]
    hybrid(x, cu_seqlens=CU)
    with _counting() as counts:
        hybrid(x, cu_seqlens=CU).sum().backward()
    return dict(counts)


PLANS = {
    "p2p": {"mode": "p2p"},
    "ulysses": {"mode": "ulysses"},
    "scan head_tail": {"mode": "scan", "layout": "head_tail"},
    "ulysses+all_gather head_tail": {"mode": "ulysses+all_gather", "layout": "head_tail", "inner_size": 2},
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("plan", PLANS, ids=list(PLANS))
def test_packed_documents_are_checked_and_masked_once_per_forward(plan: str) -> None:
    """One GDN layer or three: the same host work per training step. The model checks cu_seqlens
    once (building its context); the first GDN layer makes the documents of its spans and builds
    their masks, and the later layers and the backward reuse them (checking and building nothing)."""
    one, three = (run_ranks(_work_per_forward, 2, PLANS[plan], n, timeout_s=240) for n in (1, 3))
    for rank in range(2):
        assert one[rank] == three[rank], (rank, one[rank], three[rank])
        work = three[rank]
        assert work["cu checks"] == 1 and work.get("checks", 0) == 0, work
        assert work["documents"] >= 1 and work["conv masks"] >= 1 and work["chunk masks"] >= 1, work
