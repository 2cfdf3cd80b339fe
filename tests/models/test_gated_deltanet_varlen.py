"""The torch GDN layer on packed documents (cu_seqlens or transformers' packed position_ids):
outputs and gradients equal each document run alone, through our layer and through transformers'
``Qwen3_5GatedDeltaNet`` with the same weights; and the layer's checks on the packed keywords."""

from __future__ import annotations

import pytest
import torch
from oracles import assert_close
from tiny_models import transformers_gdn_layer
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

from hyperpar_gdn.models import GatedDeltaNet

# fp64 against fp64 (measured ~1e-15).
FP64_TOL = 1e-12
# Against transformers, which computes the gates (and so the whole rule) in fp32 even in a fp64
# model (docs/maths.md, what the tests hold the code to): measured 8e-7 on the output, dx and every parameter gradient.
HF_TOL = 1e-5

CASES = {
    "one-doc": (0, 70),
    "shorter-than-conv": (0, 1, 3, 5, 40, 70),  # documents of 1 and 2 tokens (conv width 4)
    "at-chunk-start": (0, 64, 70),
    "many-docs": (0, 9, 20, 21, 33, 50, 51, 52, 64, 70),
    "T-not-multiple-of-chunk": (0, 100, 130),
}


def _layers() -> tuple[GatedDeltaNet, Qwen3_5GatedDeltaNet]:
    hf = transformers_gdn_layer(dtype=torch.float64)
    ours = GatedDeltaNet(32, 2, 4, 16, 8).double()
    ours.load_state_dict(hf.state_dict())
    return ours, hf


def _position_ids(cu: tuple[int, ...]) -> torch.Tensor:
    return torch.cat([torch.arange(b - a) for a, b in zip(cu[:-1], cu[1:], strict=True)])[None]


def _run(
    layer: torch.nn.Module, x: torch.Tensor, cot: torch.Tensor, **kwargs: object
) -> dict[str, torch.Tensor]:
    """Output, input gradient and parameter gradients of sum(layer(x) * cot)."""
    x = x.detach().requires_grad_(True)
    layer.zero_grad()
    out = layer(x, **kwargs)
    (out * cot).sum().backward()
    return {"output": out.detach(), "dx": x.grad} | {n: p.grad.clone() for n, p in layer.named_parameters()}


def _per_document(layer: torch.nn.Module, x: torch.Tensor, cot: torch.Tensor, cu: tuple[int, ...]) -> dict:
    """The same quantities with each document run alone (parameter gradients summed)."""
    x = x.detach().requires_grad_(True)
    layer.zero_grad()
    outs = [layer(x[:, a:b]) for a, b in zip(cu[:-1], cu[1:], strict=True)]
    out = torch.cat(outs, 1)
    (out * cot).sum().backward()
    return {"output": out.detach(), "dx": x.grad} | {n: p.grad.clone() for n, p in layer.named_parameters()}


def _inputs(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(t)
    return (torch.randn(1, t, 32, generator=gen, dtype=torch.float64) for _ in range(2))


@pytest.mark.parametrize("keyword", ["cu_seqlens", "position_ids", "both"])
@pytest.mark.parametrize("cu", list(CASES.values()), ids=list(CASES))
def test_packed_equals_documents_alone(cu: tuple[int, ...], keyword: str) -> None:
    ours, _ = _layers()
    x, cot = _inputs(cu[-1])
    kwargs = {
        "cu_seqlens": {"cu_seqlens": torch.tensor(cu)},
        "position_ids": {"position_ids": _position_ids(cu)},
        "both": {"cu_seqlens": torch.tensor(cu), "position_ids": _position_ids(cu)},
    }[keyword]
    packed = _run(ours, x, cot, **kwargs)
    alone = _per_document(ours, x, cot, cu)
    for name, value in packed.items():
        assert_close(name, value, alone[name], FP64_TOL)
    if len(cu) > 2:  # guards the comparison: unpacked, the documents do see each other
        assert (_run(ours, x, cot)["output"] - alone["output"]).abs().max() > 1e-4


@pytest.mark.parametrize("cu", list(CASES.values()), ids=list(CASES))
def test_packed_equals_transformers_per_document(cu: tuple[int, ...]) -> None:
    ours, hf = _layers()
    x, cot = _inputs(cu[-1])
    packed = _run(ours, x, cot, cu_seqlens=torch.tensor(cu))
    expected = _per_document(hf, x, cot, cu)
    assert set(packed) == set(expected)
    for name, value in packed.items():
        assert_close(name, value, expected[name], HF_TOL)


BAD = {
    "batch-2": (
        {"cu_seqlens": torch.tensor([0, 5, 12])},
        2,
        r"packed documents \(cu_seqlens\) need batch size B=1; got B=2",
    ),
    "position-ids-batch-2": (
        {"position_ids": torch.arange(12)[None].repeat(2, 1)},
        2,
        r"packed documents \(position_ids\) need batch size B=1; got B=2",
    ),
    "cu-not-at-0": ({"cu_seqlens": torch.tensor([2, 5, 12])}, 1, r"start at 0; got cu_seqlens\[0\]=2"),
    "cu-not-increasing": ({"cu_seqlens": torch.tensor([0, 7, 5, 12])}, 1, r"strictly increasing"),
    "cu-not-T": ({"cu_seqlens": torch.tensor([0, 5, 11])}, 1, r"end at the sequence length T=12"),
    "position-ids-length": (
        {"position_ids": torch.arange(11)[None]},
        1,
        r"position_ids must be \[1, T\] with T=12; got 11 positions",
    ),
    "position-ids-skip": (
        {"position_ids": torch.tensor([[0, 1, 2, 4, 5, 6, 7, 8, 9, 10, 11, 12]])},
        1,
        r"position_ids\[2\]=2, position_ids\[3\]=4",
    ),
    "disagree": (
        {"cu_seqlens": torch.tensor([0, 5, 12]), "position_ids": _position_ids((0, 6, 12))},
        1,
        r"cu_seqlens and position_ids describe different documents: cu_seqlens starts them at \[0, 5\], "
        r"position_ids at \[0, 6\]",
    ),
}


@pytest.mark.parametrize("bad", list(BAD))
def test_bad_packed_keywords(bad: str) -> None:
    kwargs, batch, message = BAD[bad]
    ours, _ = _layers()
    with pytest.raises(ValueError, match=message):
        ours(torch.randn(batch, 12, 32, dtype=torch.float64), **kwargs)


def test_packed_keywords_are_keyword_only() -> None:
    ours, _ = _layers()
    with pytest.raises(TypeError):
        ours(torch.randn(1, 12, 32, dtype=torch.float64), None, torch.tensor([0, 12]))
