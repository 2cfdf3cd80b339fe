"""The layer stages with packed documents: the causal conv restarts at each document (against a
token-by-token reference and against each document alone), also across a halo as a context-parallel
shard sees it, the stage checks, and the documents a forward's context hands to every layer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from oracles import assert_close

from hyperpar_gdn.ops.gdn import varlen
from hyperpar_gdn.ops.gdn.kernels import gdn_rule
from hyperpar_gdn.ops.gdn.layer import conv_silu, conv_silu_reference
from hyperpar_gdn.ops.gdn.varlen import Documents
from hyperpar_gdn.platform.torch_ops import TorchOps

XP = TorchOps()
TOL = 1e-13  # fp64, the same products summed in another order
WIDTH = 4
CHANNELS = 6

CONV_CASES = {
    "one-doc": (0, 23),
    "shorter-than-width": (0, 1, 3, 5, 6, 20, 23),
    "every-token": tuple(range(24)),
    "long-then-short": (0, 17, 19, 23),
}


def _inputs(t: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    mixed = torch.randn(1, t, CHANNELS, generator=gen, dtype=torch.float64)
    weight = torch.randn(CHANNELS, 1, WIDTH, generator=gen, dtype=torch.float64)
    return mixed, weight


def _starts(cu: tuple[int, ...]) -> np.ndarray:
    starts = np.zeros(cu[-1], dtype=bool)
    starts[list(cu[:-1])] = True
    return starts


def _alone(mixed: torch.Tensor, weight: torch.Tensor, cu: tuple[int, ...]) -> torch.Tensor:
    """Each document through torch's own causal conv (zero left padding), then SiLU."""
    docs = []
    for start, stop in zip(cu[:-1], cu[1:], strict=True):
        x = F.pad(mixed[:, start:stop].transpose(1, 2), (WIDTH - 1, 0))
        docs.append(F.silu(F.conv1d(x, weight, groups=CHANNELS)).transpose(1, 2))
    return torch.cat(docs, 1)


@pytest.mark.parametrize("cu", list(CONV_CASES.values()), ids=list(CONV_CASES))
def test_conv_restarts_per_document(cu: tuple[int, ...]) -> None:
    mixed, weight = _inputs(cu[-1])
    expected = _alone(mixed, weight, cu)
    assert_close("conv", conv_silu(XP, mixed, weight, doc_starts=_starts(cu)), expected, TOL)
    assert_close("reference", conv_silu_reference(XP, mixed, weight, _starts(cu)), expected, TOL)
    if len(cu) > 2:  # guards the comparison: the plain conv does read across documents
        assert (conv_silu(XP, mixed, weight) - expected).abs().max() > 1e-3


@pytest.mark.parametrize("split", [1, 2, 3, 5, 6, 7, 12], ids=lambda s: f"split{s}")
def test_conv_halo_is_masked_by_document(split: int) -> None:
    """A shard starting at ``split`` with the W-1 tokens before it as its halo: the same as the
    whole row's conv, wherever the documents start around the split (the halo may be partly
    padding, hold a document start, or belong to another document entirely)."""
    cu = (0, 2, 3, 6, 14, 23)
    mixed, weight = _inputs(cu[-1])
    starts = _starts(cu)
    whole = conv_silu(XP, mixed, weight, doc_starts=starts)
    lo = split - (WIDTH - 1)
    halo = F.pad(mixed[:, max(lo, 0) : split], (0, 0, max(-lo, 0), 0))
    halo_starts = np.concatenate([np.zeros(max(-lo, 0), dtype=bool), starts[max(lo, 0) : split]])
    shard = conv_silu(
        XP, mixed[:, split:], weight, halo=halo, doc_starts=starts[split:], halo_doc_starts=halo_starts
    )
    assert_close("shard", shard, whole[:, split:], TOL)


def test_conv_gradients_match_documents_alone() -> None:
    cu = CONV_CASES["shorter-than-width"]
    mixed, weight = _inputs(cu[-1])
    mixed.requires_grad_(True)
    weight.requires_grad_(True)
    cot = torch.randn(1, cu[-1], CHANNELS, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    grads = torch.autograd.grad(
        (conv_silu(XP, mixed, weight, doc_starts=_starts(cu)) * cot).sum(), [mixed, weight]
    )
    expected = torch.autograd.grad((_alone(mixed, weight, cu) * cot).sum(), [mixed, weight])
    for name, grad, ref in zip(("dmixed", "dweight"), grads, expected, strict=True):
        assert_close(name, grad, ref, TOL)


def test_conv_stage_checks() -> None:
    mixed, weight = _inputs(10)
    halo = torch.zeros(1, WIDTH - 1, CHANNELS, dtype=torch.float64)
    starts = np.zeros(10, dtype=bool)
    with pytest.raises(ValueError, match=r"doc_starts must be \[T\] or \[1, T\] with T=10; got shape \(9,\)"):
        conv_silu(XP, mixed, weight, doc_starts=starts[:9])
    with pytest.raises(ValueError, match="a halo with doc_starts needs halo_doc_starts"):
        conv_silu(XP, mixed, weight, halo=halo, doc_starts=starts)
    with pytest.raises(ValueError, match="halo_doc_starts needs doc_starts"):
        conv_silu(XP, mixed, weight, halo=halo, halo_doc_starts=np.zeros(3, dtype=bool))
    with pytest.raises(ValueError, match="halo_doc_starts was given without a halo"):
        conv_silu(XP, mixed, weight, doc_starts=starts, halo_doc_starts=np.zeros(3, dtype=bool))
    with pytest.raises(
        ValueError, match=r"halo_doc_starts must be \[T\] or \[1, T\] with T=3; got shape \(4,\)"
    ):
        conv_silu(XP, mixed, weight, halo=halo, doc_starts=starts, halo_doc_starts=np.zeros(4, dtype=bool))
    with pytest.raises(ValueError, match=r"batch size B=1; got B=2"):
        conv_silu(XP, torch.cat([mixed, mixed]), weight, doc_starts=starts)


def test_documents_build_their_masks_once_for_every_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same :class:`Documents` handed to two GDN layers' stages (as a forward's context hands
    them): the results equal those of the raw arrays, the documents are checked once (when made) and
    their conv and chunk masks built once, by the first layer; a refused combination names it."""
    cu = (0, 3, 11, 20, 23)
    starts = _starts(cu)
    split = 6  # a shard from token 6 on, with a halo holding a document start
    halo_starts = starts[split - (WIDTH - 1) : split]
    docs = Documents.of(starts[split:], seq_len=cu[-1] - split, halo=halo_starts, width=WIDTH)
    built: list[str] = []
    for name in ("check_doc_starts", "conv_tap_masks", "chunk_mask_arrays"):
        original = getattr(varlen, name)
        monkeypatch.setattr(
            varlen, name, lambda *a, _f=original, _n=name, **k: built.append(_n) or _f(*a, **k)
        )
    gen = torch.Generator().manual_seed(3)
    t, h, d = cu[-1] - split, 2, 8
    q, k, v = (torch.randn(1, t, h, d, generator=gen, dtype=torch.float64) for _ in range(3))
    g = -torch.rand(1, t, h, generator=gen, dtype=torch.float64)
    beta = torch.rand(1, t, h, generator=gen, dtype=torch.float64)
    layers = [(*_inputs(cu[-1], seed), seed) for seed in (1, 2)]  # their own weights and inputs
    got = []
    for mixed, weight, scale in layers:  # as two GDN layers of one forward: the same documents
        halo = mixed[:, split - (WIDTH - 1) : split]
        conv = conv_silu(XP, mixed[:, split:], weight, halo=halo, doc_starts=docs)
        got.append((conv, gdn_rule(q * scale, k, v, g, beta, chunk_size=4, doc_starts=docs)[0]))
    assert built == ["conv_tap_masks", "chunk_mask_arrays"], built  # by the first layer, checking nothing
    for (mixed, weight, scale), (conv, rule) in zip(layers, got, strict=True):  # as the raw arrays give
        halo = mixed[:, split - (WIDTH - 1) : split]
        raw = conv_silu(
            XP, mixed[:, split:], weight, halo=halo, doc_starts=starts[split:], halo_doc_starts=halo_starts
        )
        assert torch.equal(conv, raw)
        assert torch.equal(
            rule, gdn_rule(q * scale, k, v, g, beta, chunk_size=4, doc_starts=starts[split:])[0]
        )
    assert built.count("conv_tap_masks") == 3, built  # the raw arrays are masked on every call
    with pytest.raises(ValueError, match="give no halo_doc_starts"):
        conv_silu(XP, mixed[:, split:], weight, halo=halo, doc_starts=docs, halo_doc_starts=halo_starts)
    with pytest.raises(ValueError, match="doc_starts must cover T=5 tokens; got documents of 17"):
        conv_silu(XP, mixed[:, :5], weight, doc_starts=docs)
