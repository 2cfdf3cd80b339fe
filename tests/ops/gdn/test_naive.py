"""recurrent_gated_delta_rule (the token-by-token reference) against the definition written out with
explicit K x K matrices, and against the oracles (transformers, fla)."""

from __future__ import annotations

import itertools

import pytest
import torch
from oracles import ORACLES, Inputs, Shape, assert_close, l2norm, make_inputs

from hyperpar_gdn.ops import recurrent_gated_delta_rule

# Oracles compute in fp32 (measured differences ~5e-7).
FP32_TOL = {"o": 1e-5, "final_state": 1e-5}
# Against the fp64 definition (measured ~1e-16).
FP64_TOL = {"o": 1e-12, "final_state": 1e-12}


def definition(x: Inputs, *, use_qk_l2norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, o_t = S_t^T (q_t / sqrt(K)),
    one batch entry and value head at a time; value head j reads q/k head j // (H / Hk)."""
    b, t, hk, dk = x.q.shape
    h, dv = x.v.shape[2], x.v.shape[3]
    eye = torch.eye(dk, dtype=torch.float64)
    o = torch.zeros(b, t, h, dv, dtype=torch.float64)
    states = torch.zeros(b, h, dk, dv, dtype=torch.float64)
    for bi, hi in itertools.product(range(b), range(h)):
        s = torch.zeros(dk, dv, dtype=torch.float64) if x.initial_state is None else x.initial_state[bi, hi]
        for ti in range(t):
            q, k = x.q[bi, ti, hi // (h // hk)], x.k[bi, ti, hi // (h // hk)]
            if use_qk_l2norm:
                q, k = l2norm(q), l2norm(k)
            q = q / dk**0.5
            beta, v = x.beta[bi, ti, hi], x.v[bi, ti, hi]
            s = torch.exp(x.g[bi, ti, hi]) * (eye - beta * torch.outer(k, k)) @ s + beta * torch.outer(k, v)
            o[bi, ti, hi] = s.T @ q
        states[bi, hi] = s
    return o, states


SMALL = [
    (Shape(B=2, T=t, H=4, Hk=hk, K=6, V=5), state, l2)
    for t, hk, state, l2 in itertools.product((1, 9), (1, 4), (True, False), (True, False))
]


@pytest.mark.parametrize(
    "shape,with_state,l2",
    SMALL,
    ids=[f"{s.id}-{'s0' if st else 'nos0'}-{'l2' if l2 else 'unitqk'}" for s, st, l2 in SMALL],
)
def test_matches_definition_fp64(shape: Shape, with_state: bool, l2: bool) -> None:
    x = make_inputs(shape, dtype=torch.float64, seed=shape.T, with_state=with_state, unit_qk=not l2)
    o, s = recurrent_gated_delta_rule(
        *x.qkvgb(), initial_state=x.initial_state, output_final_state=True, use_qk_l2norm_in_kernel=l2
    )
    o_ref, s_ref = definition(x, use_qk_l2norm=l2)
    assert o.dtype == s.dtype == torch.float64
    assert_close("o", o, o_ref, FP64_TOL["o"])
    assert_close("final_state", s, s_ref, FP64_TOL["final_state"])


ORACLE_CASES = [
    (Shape(B=2, T=t, H=4, Hk=hk), dtype, state, l2)
    for t, hk, dtype, state, l2 in itertools.product(
        (1, 63, 200), (2, 4), (torch.float32, torch.float64), (True, False), (True, False)
    )
    if t == 63 or (hk == 2 and state and l2)  # every option at T=63, the default elsewhere
]


def _oracle_case_id(case: tuple[Shape, torch.dtype, bool, bool]) -> str:
    shape, dtype, state, l2 = case
    return f"{shape.id}-{'fp32' if dtype == torch.float32 else 'fp64'}-{'s0' if state else 'nos0'}-{'l2' if l2 else 'unitqk'}"


@pytest.mark.parametrize("oracle", list(ORACLES))
@pytest.mark.parametrize("case", ORACLE_CASES, ids=[_oracle_case_id(c) for c in ORACLE_CASES])
def test_matches_oracle(case: tuple[Shape, torch.dtype, bool, bool], oracle: str) -> None:
    shape, dtype, with_state, l2 = case
    x = make_inputs(shape, dtype=dtype, seed=shape.T + 1, with_state=with_state, unit_qk=not l2)
    kwargs = {"initial_state": x.initial_state, "output_final_state": True, "use_qk_l2norm_in_kernel": l2}
    o, s = recurrent_gated_delta_rule(*x.qkvgb(), **kwargs)
    o_ref, s_ref = ORACLES[oracle](*x.qkvgb(), chunk_size=16, **kwargs)
    assert o.dtype == dtype
    assert_close("o", o, o_ref, FP32_TOL["o"])
    assert_close("final_state", s, s_ref, FP32_TOL["final_state"])


@pytest.mark.parametrize(
    "dtype,state_dtype",
    [(torch.float32, torch.float32), (torch.float64, torch.float64), (torch.bfloat16, torch.float32)],
    ids=["fp32", "fp64", "bf16"],
)
def test_dtypes(dtype: torch.dtype, state_dtype: torch.dtype) -> None:
    x = make_inputs(Shape(B=1, T=20, H=2), dtype=dtype)
    o, s = recurrent_gated_delta_rule(*x.qkvgb(), output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert o.dtype == dtype, "o comes back in q's dtype"
    assert s.dtype == state_dtype, "the state is accumulated in fp32 (fp64 for fp64 inputs)"
    o_ref, s_ref = recurrent_gated_delta_rule(
        *(t.to(state_dtype) for t in x.qkvgb()), output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    assert_close("final_state", s, s_ref, 0.0)


def test_final_state_only_when_asked() -> None:
    x = make_inputs(Shape(B=1, T=20, H=2), with_state=True)
    o, s = recurrent_gated_delta_rule(*x.qkvgb(), initial_state=x.initial_state)
    o_with, _ = recurrent_gated_delta_rule(*x.qkvgb(), initial_state=x.initial_state, output_final_state=True)
    assert s is None
    torch.testing.assert_close(o, o_with, rtol=0, atol=0)
