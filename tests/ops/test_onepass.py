"""The one-pass shard function (DESIGN.md section 8): one widened recurrence gives o0, Q_eff and
the summary; o0 + Q_eff S_in equals the two-pass result (summary pass, then outputs from S_in)
and the recurrent reference, with packed documents too; gradients by gradcheck."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from oracles import Inputs, Shape, assert_close, make_inputs

from hyperpar_gdn.ops import outputs_from, prepare_chunks, recurrent_gated_delta_rule, summary_from
from hyperpar_gdn.ops.onepass import apply_entering_state, one_pass

FP64_TOL = {"o": 1e-12, "s_ext": 1e-12, "m": 1e-12, "o0": 1e-12}

CASES = [
    # shape, chunk size, document starts inside the segment (None: unpacked)
    (Shape(B=2, T=75, H=4, Hk=2, K=8, V=6), 16, None),
    (Shape(B=1, T=130, H=2, K=8, V=8), 32, None),
    (Shape(B=1, T=100, H=4, Hk=2, K=8, V=6), 16, (0,)),  # a document starts at token 0
    (Shape(B=1, T=100, H=4, Hk=2, K=8, V=6), 16, (5, 16, 40, 41)),  # cuts inside and at chunk starts
    (Shape(B=1, T=70, H=2, K=6, V=8), 64, (69,)),  # the last token starts a document
]
IDS = [f"{s.id}-C{c}-{'unpacked' if d is None else 'docs' + '_'.join(map(str, d))}" for s, c, d in CASES]


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


@pytest.mark.parametrize("shape,chunk_size,starts", CASES, ids=IDS)
def test_one_pass_equals_two_passes_and_the_recurrence(
    shape: Shape, chunk_size: int, starts: tuple[int, ...] | None
) -> None:
    x = make_inputs(shape, dtype=torch.float64, seed=shape.T, with_state=True)
    prep = prepare_chunks(
        *x.qkvgb(),
        chunk_size=chunk_size,
        use_qk_l2norm_in_kernel=True,
        doc_starts=_doc_starts(shape.T, starts),
    )
    passed = one_pass(prep)
    o = apply_entering_state(passed, x.initial_state, seq_len=shape.T)
    o_two, _ = outputs_from(prep, x.initial_state)
    s_ext, m = summary_from(prep)
    assert tuple(passed.q_eff.shape) == tuple(passed.o0.shape[:-1]) + (shape.K,)
    assert_close("o", o, o_two, FP64_TOL["o"])
    assert_close("o", o, _recurrent(x, x.initial_state, starts), FP64_TOL["o"])
    assert_close("s_ext", passed.s_ext, s_ext, FP64_TOL["s_ext"])
    assert_close("m", passed.m, m, FP64_TOL["m"])
    if starts is not None:  # past the first document start the entering state reaches nothing
        first = starts[0]
        q_eff = apply_entering_state(passed._replace(o0=passed.o0 * 0), x.initial_state, seq_len=shape.T)
        assert q_eff[:, first:].abs().max().item() == 0.0
        assert passed.m.abs().max().item() == 0.0


@pytest.mark.parametrize("shape,chunk_size,starts", CASES[:1] + CASES[3:4], ids=IDS[:1] + IDS[3:4])
def test_plain_pass_is_the_zero_state_case(
    shape: Shape, chunk_size: int, starts: tuple[int, ...] | None
) -> None:
    """widened=False (the first shard): the outputs and final state from a zero entering state."""
    x = make_inputs(shape, dtype=torch.float64, seed=shape.T)
    prep = prepare_chunks(
        *x.qkvgb(),
        chunk_size=chunk_size,
        use_qk_l2norm_in_kernel=True,
        doc_starts=_doc_starts(shape.T, starts),
    )
    passed = one_pass(prep, widened=False)
    assert passed.q_eff is None and passed.m is None
    o_ref, s_ref = outputs_from(prep, None)
    assert_close("o0", apply_entering_state(passed, None, seq_len=shape.T), o_ref, FP64_TOL["o0"])
    assert_close("s_ext", passed.s_ext, s_ref, FP64_TOL["s_ext"])


@pytest.mark.parametrize("starts", [None, (0,), (2, 5)], ids=["unpacked", "docs0", "docs2_5"])
def test_gradcheck(starts: tuple[int, ...] | None) -> None:
    """Gradients of (o, S_ext, M) with respect to q, k, v, g, beta and S_in."""
    shape = Shape(B=1, T=7, H=2, Hk=1, K=3, V=2)
    x = make_inputs(shape, dtype=torch.float64, with_state=True, requires_grad=True)
    flags = _doc_starts(shape.T, starts)

    def fn(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        *qkvgb, s_in = args
        prep = prepare_chunks(*qkvgb, chunk_size=3, use_qk_l2norm_in_kernel=True, doc_starts=flags)
        passed = one_pass(prep)
        return apply_entering_state(passed, s_in, seq_len=shape.T), passed.s_ext, passed.m

    assert torch.autograd.gradcheck(fn, (*x.qkvgb(), x.initial_state))


def test_gradients_equal_two_passes() -> None:
    """Backward through one pass equals backward through the summary pass plus the output pass,
    for a cotangent on the outputs and on the summary."""
    shape = Shape(B=1, T=90, H=4, Hk=2, K=8, V=6)
    x = make_inputs(shape, dtype=torch.float64, seed=3, with_state=True, requires_grad=True)
    gen = torch.Generator().manual_seed(4)
    do = torch.randn(1, 90, 4, 6, generator=gen, dtype=torch.float64)
    ds, dm = (
        torch.randn(1, 4, 8, 6, generator=gen, dtype=torch.float64),
        torch.randn(1, 4, 8, 8, generator=gen, dtype=torch.float64),
    )
    leaves = (*x.qkvgb(), x.initial_state)

    def grads(one: bool) -> tuple[torch.Tensor, ...]:
        prep = prepare_chunks(*x.qkvgb(), chunk_size=16, use_qk_l2norm_in_kernel=True)
        if one:
            passed = one_pass(prep)
            o, s_ext, m = apply_entering_state(passed, x.initial_state, seq_len=90), passed.s_ext, passed.m
        else:
            o, _ = outputs_from(prep, x.initial_state)
            s_ext, m = summary_from(prep)
        return torch.autograd.grad((o * do).sum() + (s_ext * ds).sum() + (m * dm).sum(), leaves)

    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "ds_in"), grads(True), grads(False), strict=True):
        assert_close(name, a, b, 1e-11)
