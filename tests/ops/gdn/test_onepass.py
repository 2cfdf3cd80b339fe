"""The one-pass shard function (docs/maths.md, summaries), with a local stand-in for the peers: the
summary it hands over equals the summary pass, its outputs equal the output pass and the recurrent
reference from the entering state the peers return, and its gradients (those of the shard's inputs,
and the dS_in it hands back) equal autograd through the output pass, with packed documents too."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from oracles import Inputs, Shape, assert_close, make_inputs

from hyperpar_gdn.ops import outputs_from, prepare_chunks, recurrent_gated_delta_rule, summary_from
from hyperpar_gdn.ops.gdn.onepass import shard_outputs

TOL = 1e-11  # float64

CASES = [
    # shape, chunk size, document starts inside the segment (None: unpacked)
    (Shape(B=2, T=75, H=4, Hk=2, K=8, V=6), 16, None),
    (Shape(B=1, T=130, H=2, K=8, V=8), 32, None),
    (Shape(B=1, T=100, H=4, Hk=2, K=8, V=6), 16, (0,)),  # a document starts at token 0
    (Shape(B=1, T=100, H=4, Hk=2, K=8, V=6), 16, (5, 16, 40, 41)),  # cuts inside and at chunk starts
    (Shape(B=1, T=70, H=2, K=6, V=8), 64, (69,)),  # the last token starts a document
]
IDS = [f"{s.id}-C{c}-{'unpacked' if d is None else 'docs' + '_'.join(map(str, d))}" for s, c, d in CASES]


class LocalExchange:
    """The peers of a shard: records the summary it is given and returns ``s_in``; records the
    dS_in it is given in backward and returns ``ds_out``."""

    def __init__(self, s_in: torch.Tensor, ds_out: torch.Tensor) -> None:
        self.s_in, self.ds_out = s_in, ds_out
        self.summary: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.ds_in: torch.Tensor | None = None
        self.backward_calls = 0

    def forward(self, s_ext: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
        self.summary = (s_ext, m)
        return self.s_in

    def backward(self, ds_in: torch.Tensor | None) -> torch.Tensor:
        self.ds_in = ds_in
        self.backward_calls += 1
        return self.ds_out


def _doc_starts(t: int, starts: tuple[int, ...] | None) -> np.ndarray | None:
    if starts is None:
        return None
    flags = np.zeros(t, dtype=bool)
    flags[list(starts)] = True
    return flags


def _recurrent(x: Inputs, s_in: torch.Tensor, starts: tuple[int, ...] | None) -> torch.Tensor:
    """The recurrent reference: the tokens before the first document start continue from s_in,
    every document after it from zero."""
    t = x.q.shape[1]
    cuts = [0, *(s for s in (starts or ()) if s > 0), t]
    pieces = []
    for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:], strict=True)):
        state = s_in if i == 0 and (not starts or starts[0] != 0) else None
        o, _ = recurrent_gated_delta_rule(
            *(y[:, a:b] for y in x.qkvgb()), initial_state=state, use_qk_l2norm_in_kernel=True
        )
        pieces.append(o)
    return torch.cat(pieces, 1)


def _random_like(s: torch.Tensor, seed: int) -> torch.Tensor:
    return torch.randn(s.shape, generator=torch.Generator().manual_seed(seed), dtype=s.dtype)


@pytest.mark.parametrize("shape,chunk_size,starts", CASES, ids=IDS)
def test_forward_equals_summary_and_output_passes(
    shape: Shape, chunk_size: int, starts: tuple[int, ...] | None
) -> None:
    x = make_inputs(shape, dtype=torch.float64, seed=shape.T, with_state=True)
    flags = _doc_starts(shape.T, starts)
    prep = prepare_chunks(*x.qkvgb(), chunk_size=chunk_size, use_qk_l2norm_in_kernel=True, doc_starts=flags)
    peers = LocalExchange(x.initial_state, torch.zeros_like(x.initial_state))
    o = shard_outputs(prep, peers)
    s_ext, m = summary_from(prep)
    assert_close("s_ext", peers.summary[0], s_ext, TOL)
    assert_close("m", peers.summary[1], m, TOL)
    assert_close("o", o, outputs_from(prep, x.initial_state)[0], TOL)
    assert_close("o", o, _recurrent(x, x.initial_state, starts), TOL)
    if starts is not None:  # past the first document start the entering state reaches nothing
        assert peers.summary[1].abs().max().item() == 0.0


@pytest.mark.parametrize("shape,chunk_size,starts", CASES, ids=IDS)
@pytest.mark.parametrize("widened", [True, False], ids=["widened", "first_shard"])
def test_backward_equals_autograd_through_the_output_pass(
    shape: Shape, chunk_size: int, starts: tuple[int, ...] | None, widened: bool
) -> None:
    """Cotangents do on the outputs and dS_out on the state leaving the shard: the gradients of
    q, k, v, g, beta and the dS_in handed to the peers equal autograd through
    ``outputs_from(prep, S_in)`` (a zero S_in for the first shard, which hands over nothing)."""
    x = make_inputs(shape, dtype=torch.float64, seed=shape.T + 1, with_state=True, requires_grad=True)
    flags = _doc_starts(shape.T, starts)
    s_in = x.initial_state if widened else torch.zeros_like(x.initial_state)
    do = _random_like(x.v, 5)
    ds_out = _random_like(s_in, 6)

    def prep() -> object:
        return prepare_chunks(
            *x.qkvgb(), chunk_size=chunk_size, use_qk_l2norm_in_kernel=True, doc_starts=flags
        )

    peers = LocalExchange(s_in.detach(), ds_out)
    o = shard_outputs(prep(), peers, widened=widened)
    got = torch.autograd.grad((o * do).sum(), x.qkvgb())
    assert peers.backward_calls == 1
    o_ref, s_final = outputs_from(prep(), s_in)
    want = torch.autograd.grad((o_ref * do).sum() + (s_final * ds_out).sum(), x.qkvgb())
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), got, want, strict=True):
        assert_close(name, a, b, TOL)
    if widened:
        # dS_in from the outputs alone: the peers add M^T dS_out themselves.
        (ds_in_ref,) = torch.autograd.grad((outputs_from(prep(), s_in)[0] * do).sum(), s_in)
        assert_close("ds_in", peers.ds_in, ds_in_ref, TOL)
    else:
        assert peers.ds_in is None and peers.summary[1] is None


def test_fp32_matches_the_output_pass() -> None:
    """float32 (the training dtype): outputs and gradients within fp32 rounding of the output pass."""
    shape = Shape(B=1, T=200, H=2, K=16, V=16)
    x = make_inputs(shape, dtype=torch.float32, seed=9, with_state=True, requires_grad=True)
    do = _random_like(x.v, 7)
    peers = LocalExchange(x.initial_state.detach(), torch.zeros_like(x.initial_state))

    def prep() -> object:
        return prepare_chunks(*x.qkvgb(), chunk_size=64, use_qk_l2norm_in_kernel=True)

    o = shard_outputs(prep(), peers)
    got = torch.autograd.grad((o * do).sum(), x.qkvgb())
    o_ref, _ = outputs_from(prep(), x.initial_state.detach())
    want = torch.autograd.grad((o_ref * do).sum(), x.qkvgb())
    assert_close("o", o, o_ref, 1e-5)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), got, want, strict=True):
        assert_close(name, a, b, 1e-4)
