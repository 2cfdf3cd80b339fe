"""Causal softmax attention (hyperpar_gdn.ops.attention.softmax) on torch: the blockwise path and the
fused-kernel path equal the dense reference in fp64 (outputs and the gradients of q, k and v),
for causal rows, grouped KV heads, padding, packed documents whose boundaries fall inside blocks,
documents shorter than a block, a shard of the queries and two query fragments over keys in any
order; the dense reference equals transformers' attention function; the block maps skip what no
query sees; ``HP_ATTENTION`` forces a path."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from hyperpar_gdn.ops.attention.softmax import attention, causal_attention, dense_attention
from hyperpar_gdn.ops.attention.visibility import FULL, NONE, PARTIAL, Tokens, block_map, visible_segments
from hyperpar_gdn.platform import ops_for

XP = ops_for(torch.empty(0))
TOL = 1e-12  # fp64, relative to each tensor's scale
DOCS = np.array([0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 2, 3, 3, 3, 3, 4, 4, 4, 4])  # 19 tokens, 5 documents


@dataclass(frozen=True)
class Case:
    name: str
    queries: Tokens
    keys: Tokens
    key_mask: np.ndarray | None = None
    heads: tuple[int, int] = (4, 2)


def _fragments(docs: np.ndarray | None) -> tuple[Tokens, Tokens]:
    """Queries: a head and a tail fragment (tokens 0..4 and 14..18); keys: the whole sequence in
    the order of two ranks' fragments (0..4, 14..18, then 5..13)."""
    t = 19

    def span(a: int, b: int) -> Tokens:
        return Tokens.span(a, b, None if docs is None else docs[a:b])

    queries = Tokens.cat([span(0, 5), span(14, t)])
    return queries, Tokens.cat([span(0, 5), span(14, t), span(5, 14)])


def _padding(shared: bool) -> np.ndarray:
    mask = np.ones((2, 19), np.int64)
    mask[:, :3] = 0  # left padding: queries 0..2 see no key
    if not shared:
        mask[1, :7] = 0
        mask[0, 12] = 0
    return mask


CASES = [
    Case("causal", Tokens.span(0, 19), Tokens.span(0, 19)),
    Case("mha", Tokens.span(0, 19), Tokens.span(0, 19), heads=(3, 3)),
    Case("shard", Tokens.span(8, 19), Tokens.span(0, 19)),
    Case("padding-shared", Tokens.span(0, 19), Tokens.span(0, 19), _padding(True)),
    Case("padding-per-row", Tokens.span(0, 19), Tokens.span(0, 19), _padding(False)),
    Case("packed", Tokens.span(0, 19, DOCS), Tokens.span(0, 19, DOCS)),
    Case("packed-shard", Tokens.span(9, 19, DOCS[9:]), Tokens.span(0, 19, DOCS)),
    Case("fragments", *_fragments(None)),
    Case("packed-fragments", *_fragments(DOCS)),
    Case("packed-padding", Tokens.span(0, 19, DOCS), Tokens.span(0, 19, DOCS), _padding(False)),
]


def _inputs(case: Case, dtype: torch.dtype = torch.float64, seed: int = 0) -> list[torch.Tensor]:
    h, hkv = case.heads
    b = 2 if case.key_mask is None else case.key_mask.shape[0]
    g = torch.Generator().manual_seed(seed)
    shapes = [(b, h, len(case.queries), 8), (b, hkv, len(case.keys), 8), (b, hkv, len(case.keys), 8)]
    return [torch.randn(*s, generator=g, dtype=torch.float64).to(dtype).requires_grad_() for s in shapes]


def _value_and_grads(case: Case, path: str, block_size: int = 4, dtype: torch.dtype = torch.float64):
    q, k, v = _inputs(case, dtype)
    o = attention(
        XP,
        q,
        k,
        v,
        queries=case.queries,
        keys=case.keys,
        key_mask=case.key_mask,
        path=path,
        block_size=block_size,
    )
    cot = torch.randn(o.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64).to(dtype)
    return (o, *torch.autograd.grad((o * cot).sum(), (q, k, v)))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize(
    ("path", "block_size"), [("blockwise", 4), ("blockwise", 5), ("blockwise", 64), ("auto", 4)]
)
def test_paths_equal_the_dense_reference(case: Case, path: str, block_size: int) -> None:
    expected = _value_and_grads(case, "reference")
    actual = _value_and_grads(case, path, block_size)
    for name, a, e in zip(("o", "dq", "dk", "dv"), actual, expected, strict=True):
        assert torch.isfinite(a).all(), f"{name}: non-finite"
        assert _rel(a, e) <= TOL, f"{name}: {_rel(a, e):.2e}"


def test_the_fused_path_serves_shared_padding_and_refuses_per_row_padding() -> None:
    by_name = {c.name: c for c in CASES}
    for name in ("causal", "packed-fragments", "padding-shared"):
        expected = _value_and_grads(by_name[name], "reference")
        actual = _value_and_grads(by_name[name], "fused")
        assert max(_rel(a, e) for a, e in zip(actual, expected, strict=True)) <= TOL, name
    with pytest.raises(ValueError, match="no fused kernel for padding that differs between batch rows"):
        _value_and_grads(by_name["padding-per-row"], "fused")


@pytest.mark.parametrize("path", ["blockwise", "auto"])
def test_queries_that_see_no_key_give_zeros_and_no_gradient(path: str) -> None:
    case = CASES[3]  # left padding of 3 tokens
    o, dq, _, _ = _value_and_grads(case, path)
    assert (o[:, :, :3] == 0).all() and (dq[:, :, :3] == 0).all()
    assert (o[:, :, 3:].abs().sum(-1) > 0).all()


def test_bf16_inputs_keep_their_dtype_and_stay_close() -> None:
    case = CASES[5]
    expected = _value_and_grads(case, "reference")
    for path in ("blockwise", "auto"):
        actual = _value_and_grads(case, path, dtype=torch.bfloat16)
        assert all(a.dtype == torch.bfloat16 for a in actual)
        assert max(_rel(a, e) for a, e in zip(actual, expected, strict=True)) <= 2e-2, path


@pytest.mark.parametrize("case", [CASES[0], CASES[4], CASES[6]], ids=lambda c: c.name)
def test_dense_reference_equals_transformers_attention(case: Case) -> None:
    """transformers' Qwen3.5 eager attention (softmax in fp32) with an additive [B, 1, Tq, Tk] mask."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import eager_attention_forward

    q, k, v = _inputs(case)
    mask = torch.from_numpy(_visible(case))
    bias = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, torch.finfo(torch.float64).min)
    module = torch.nn.Module()
    module.num_key_value_groups = case.heads[0] // case.heads[1]
    expected, _ = eager_attention_forward(module, q, k, v, bias, scaling=8**-0.5)
    ours = dense_attention(XP, q, k, v, queries=case.queries, keys=case.keys, key_mask=case.key_mask)
    seen = mask.any(-1)[:, 0]  # [B, Tq]: transformers averages all values where nothing is seen
    got = ours.transpose(1, 2)[seen]
    assert _rel(got, expected[seen]) <= 1e-6  # its softmax runs in fp32


def _visible(case: Case) -> np.ndarray:
    from hyperpar_gdn.ops.attention.visibility import visible_pairs

    vis = visible_pairs(case.queries, case.keys, case.key_mask)
    return np.broadcast_to(vis, (2, *vis.shape[1:]))[:, None].copy()


def test_block_map_skips_hidden_blocks_and_masks_only_the_diagonal() -> None:
    found = block_map(Tokens.span(0, 16), Tokens.span(0, 16), None, block_q=4, block_k=4)
    expected = np.array([[PARTIAL, NONE, NONE, NONE]] * 4)
    for i in range(4):
        expected[i, :i] = FULL
        expected[i, i] = PARTIAL
        expected[i, i + 1 :] = NONE
    assert (found.kind == expected).all(), found.kind
    docs = np.repeat([0, 1], 8)  # two documents of two blocks each: the cross-document blocks go
    found = block_map(Tokens.span(0, 16, docs), Tokens.span(0, 16, docs), None, block_q=4, block_k=4)
    assert (found.kind[2:, :2] == NONE).all() and found.kind[3, 2] == FULL


def test_visible_segments_of_one_causal_sequence_is_one_causal_call() -> None:
    found = visible_segments(Tokens.span(0, 16), Tokens.span(0, 16), None)
    assert [(s.q0, s.q1, s.k0, s.k1, s.causal) for s in found.segments] == [(0, 16, 0, 16, True)]
    found = visible_segments(Tokens.span(8, 16), Tokens.span(0, 16), None)  # a later shard: prefix + square
    assert [(s.q0, s.q1, s.k0, s.k1, s.causal) for s in found.segments] == [
        (0, 8, 0, 8, False),
        (0, 8, 8, 16, True),
    ]


def test_hp_attention_forces_a_path_and_refuses_unknown_values(monkeypatch: pytest.MonkeyPatch) -> None:
    case = CASES[5]
    q, k, v = (x.detach() for x in _inputs(case))

    def run(path: str | None = None) -> torch.Tensor:
        return attention(XP, q, k, v, queries=case.queries, keys=case.keys, path=path)

    for value in ("reference", "blockwise", "fused"):
        monkeypatch.setenv("HP_ATTENTION", value)
        assert torch.equal(run(), run(value)), value
    monkeypatch.setenv("HP_ATTENTION", "reference")
    assert not torch.equal(run(), run("blockwise"))  # the switch changes the computation
    monkeypatch.setenv("HP_ATTENTION", "flash")
    with pytest.raises(
        ValueError, match="HP_ATTENTION='flash' is not an attention path; valid values are auto"
    ):
        run()


def test_bad_inputs_name_the_values() -> None:
    q, k, v = (x.detach() for x in _inputs(CASES[0]))
    with pytest.raises(
        ValueError, match="queries describe 18 tokens and keys 19, but the tensors hold Tq=19"
    ):
        attention(XP, q, k, v, queries=Tokens.span(0, 18), keys=Tokens.span(0, 19))
    with pytest.raises(ValueError, match="need docs on both the queries and the keys"):
        attention(XP, q, k, v, queries=Tokens.span(0, 19, DOCS), keys=Tokens.span(0, 19))
    with pytest.raises(ValueError, match=r"key_mask must be \[B, Tk\] = \(2, 19\); got \(1, 19\)"):
        attention(XP, q, k, v, queries=Tokens.span(0, 19), keys=Tokens.span(0, 19), key_mask=np.ones((1, 19)))
    with pytest.raises(ValueError, match="query heads H=4 must be a multiple of key/value heads Hkv=3"):
        attention(
            XP,
            q,
            k[:, :1].expand(2, 3, 19, 8),
            v[:, :1].expand(2, 3, 19, 8),
            queries=Tokens.span(0, 19),
            keys=Tokens.span(0, 19),
        )
    with pytest.raises(ValueError, match=r"queries at positions \[10, 29\) need keys up to position 28"):
        causal_attention(XP, q, k, v, q_offset=10)


@pytest.mark.parametrize("path", ["blockwise", "auto", "reference"])
def test_saved_activations_hold_no_query_key_matrix(path: str) -> None:
    """What the backward keeps is q, k, v, o and the log-sum-exp: O(T), never [Tq, Tk] (the dense
    reference does keep one, which shows the check can fail)."""
    t, h = 256, 2
    q = torch.randn(1, h, t, 8, requires_grad=True)
    k, v = (torch.randn(1, 1, t, 8, requires_grad=True) for _ in range(2))
    sizes: list[int] = []

    def pack(x: torch.Tensor) -> torch.Tensor:
        sizes.append(x.numel())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        attention(XP, q, k, v, queries=Tokens.span(0, t), keys=Tokens.span(0, t), path=path, block_size=32)
    quadratic = max(sizes) >= t * t
    assert quadratic == (path == "reference"), (path, max(sizes))
