"""chunk_gated_delta_rule against the oracles (transformers, fla), our recurrent reference, autograd's
numerical gradients, and its own input checks.

Errors are max |actual - expected| relative to max |expected|, per tensor (see oracles.assert_close).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from oracles import ORACLES, Inputs, Shape, assert_close, hf_chunk, make_inputs

from hyperpar_gdn.ops import chunk_gated_delta_rule, recurrent_gated_delta_rule

# The oracles compute in fp32; fp32 runs of ours and theirs differ by ~5e-7 here.
FP32_TOL = {"o": 1e-5, "final_state": 1e-5}
# Gradients of ours (fp64) against transformers' (fp32 inside); measured ~6e-7.
FP32_GRAD_TOL = {"dq": 1e-5, "dk": 1e-5, "dv": 1e-5, "dg": 1e-5, "dbeta": 1e-5, "dinitial_state": 1e-5}
# Chunked against token-by-token, both in fp64; measured ~1e-15.
FP64_TOL = {"o": 1e-12, "final_state": 1e-12}
FP64_GRAD_TOL = {"dq": 1e-10, "dk": 1e-10, "dv": 1e-10, "dg": 1e-10, "dbeta": 1e-10, "dinitial_state": 1e-10}
# bf16 inputs: o is rounded to bf16 (2^-8 relative); the state stays fp32.
BF16_TOL = {"o_vs_same_inputs": 8e-3, "final_state_vs_same_inputs": 1e-6, "o_vs_fp32_inputs": 2e-2}

DTYPE_NAMES = {torch.float32: "fp32", torch.float64: "fp64", torch.bfloat16: "bf16"}


@dataclass(frozen=True)
class Case:
    shape: Shape
    chunk_size: int
    dtype: torch.dtype = torch.float32
    with_state: bool = True
    l2norm: bool = True

    @property
    def id(self) -> str:
        state = "s0" if self.with_state else "nos0"
        l2 = "l2" if self.l2norm else "unitqk"
        return f"{self.shape.id}-C{self.chunk_size}-{DTYPE_NAMES[self.dtype]}-{state}-{l2}"

    def inputs(self, *, dtype: torch.dtype | None = None, requires_grad: bool = False) -> Inputs:
        # Without the in-kernel l2norm the caller passes unit q, k (as a GDN layer does).
        return make_inputs(
            self.shape,
            dtype=dtype or self.dtype,
            seed=self.shape.T * 100 + self.chunk_size,
            with_state=self.with_state,
            unit_qk=not self.l2norm,
            requires_grad=requires_grad,
        )


# Awkward lengths against every chunk size (GQA, initial state, in-kernel l2norm) ...
T_BY_C = [Case(Shape(B=2, T=t, H=4, Hk=2), c) for t in (1, 63, 75, 130, 200) for c in (16, 32, 64)]
# ... and every option at one awkward length.
OPTIONS = [
    Case(Shape(B=2, T=75, H=4, Hk=hk), 32, dtype, state, l2)
    for dtype, state, hk, l2 in itertools.product(
        (torch.float32, torch.float64), (True, False), (2, 4), (True, False)
    )
]
CASES = T_BY_C + OPTIONS


def run(fn: Callable, x: Inputs, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    o, s = fn(
        *x.qkvgb(),
        chunk_size=case.chunk_size,
        initial_state=x.initial_state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=case.l2norm,
    )
    return o, s


def ours_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    chunk_size: int,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Our token-by-token reference, called like the chunked functions (chunk_size unused)."""
    del chunk_size
    return recurrent_gated_delta_rule(q, k, v, g, beta, **kwargs)


def input_grads(fn: Callable, x: Inputs, case: Case) -> dict[str, torch.Tensor]:
    """Gradients of every input for a fixed random cotangent on o and the final state."""
    o, s = run(fn, x, case)
    gen = torch.Generator().manual_seed(7)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)
    ds = torch.randn(s.shape, generator=gen, dtype=torch.float64).to(s.dtype)
    leaves = x.leaves()
    grads = torch.autograd.grad((o * do).sum() + (s * ds).sum(), list(leaves.values()))
    return dict(zip(leaves, grads, strict=True))


@pytest.mark.parametrize("oracle", list(ORACLES))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_matches_oracle(case: Case, oracle: str) -> None:
    x = case.inputs()
    o, s = run(chunk_gated_delta_rule, x, case)
    o_ref, s_ref = run(ORACLES[oracle], x, case)
    assert o.dtype == case.dtype, "o comes back in the input dtype"
    assert s.dtype == case.dtype, "the final state is fp32 for fp32 input, fp64 for fp64"
    assert_close("o", o, o_ref, FP32_TOL["o"])
    assert_close("final_state", s, s_ref, FP32_TOL["final_state"])


FP64_CASES = [Case(c.shape, c.chunk_size, torch.float64, c.with_state, c.l2norm) for c in T_BY_C] + [
    c for c in OPTIONS if c.dtype == torch.float64
]


@pytest.mark.parametrize("case", FP64_CASES, ids=lambda c: c.id)
def test_matches_recurrent_fp64(case: Case) -> None:
    x = case.inputs()
    o, s = run(chunk_gated_delta_rule, x, case)
    o_ref, s_ref = run(ours_recurrent, x, case)
    assert_close("o", o, o_ref, FP64_TOL["o"])
    assert_close("final_state", s, s_ref, FP64_TOL["final_state"])


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 64, 256])
def test_chunk_size_does_not_change_results(chunk_size: int) -> None:
    case = Case(Shape(B=1, T=75, H=2), chunk_size, torch.float64)
    x = case.inputs()
    o, s = run(chunk_gated_delta_rule, x, case)
    o_ref, s_ref = run(chunk_gated_delta_rule, x, Case(case.shape, 32, torch.float64))
    assert_close("o", o, o_ref, FP64_TOL["o"])
    assert_close("final_state", s, s_ref, FP64_TOL["final_state"])


def test_initial_state_matters() -> None:
    """Guards the initial-state comparisons above against a state that decays to nothing."""
    case = Case(Shape(B=1, T=130, H=2), 32)
    x = case.inputs()
    o, s = run(chunk_gated_delta_rule, x, case)
    x.initial_state = torch.zeros_like(x.initial_state)
    o0, s0 = run(chunk_gated_delta_rule, x, case)
    assert (o - o0)[:, -1].abs().max() > 1e-3 * o.abs().max()
    assert (s - s0).abs().max() > 1e-3 * s.abs().max()


def test_final_state_only_when_asked() -> None:
    x = make_inputs(Shape(B=1, T=40, H=2), with_state=True)
    o, s = chunk_gated_delta_rule(*x.qkvgb(), initial_state=x.initial_state)
    assert s is None
    o_with, s_with = chunk_gated_delta_rule(
        *x.qkvgb(), initial_state=x.initial_state, output_final_state=True
    )
    assert s_with is not None and tuple(s_with.shape) == (1, 2, 16, 16)
    torch.testing.assert_close(o, o_with, rtol=0, atol=0)


def test_gqa_heads_are_interleaved() -> None:
    """Value head j reads q/k head j // (H / Hk), as transformers' repeat_interleave does."""
    x = make_inputs(Shape(B=1, T=50, H=4, Hk=2), dtype=torch.float64)
    o, _ = chunk_gated_delta_rule(*x.qkvgb(), use_qk_l2norm_in_kernel=True)
    rep = (x.q.repeat_interleave(2, 2), x.k.repeat_interleave(2, 2), x.v, x.g, x.beta)
    o_rep, _ = chunk_gated_delta_rule(*rep, use_qk_l2norm_in_kernel=True)
    tiled = (x.q.repeat(1, 1, 2, 1), x.k.repeat(1, 1, 2, 1), x.v, x.g, x.beta)
    o_tiled, _ = chunk_gated_delta_rule(*tiled, use_qk_l2norm_in_kernel=True)
    assert_close("o", o, o_rep, FP64_TOL["o"])
    assert (o - o_tiled).abs().max() > 1e-3, "tiled heads must give a different result"


GRAD_CASES = [
    Case(Shape(B=2, T=t, H=4, Hk=2), c, torch.float64, True, l2)
    for (t, c), l2 in itertools.product(((1, 16), (63, 16), (75, 32), (130, 64), (200, 32)), (True, False))
] + [Case(Shape(B=1, T=75, H=2, K=8, V=24), 16, torch.float64, False, True)]


@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: c.id)
def test_grads_match_transformers(case: Case) -> None:
    x = case.inputs(requires_grad=True)
    grads = input_grads(chunk_gated_delta_rule, x, case)
    expected = input_grads(hf_chunk, x, case)
    assert set(grads) == set(FP32_GRAD_TOL) - ({"dinitial_state"} if x.initial_state is None else set())
    for name, grad in grads.items():
        assert grad.dtype == torch.float64, name
        assert_close(name, grad, expected[name], FP32_GRAD_TOL[name])


@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: c.id)
def test_grads_match_recurrent_fp64(case: Case) -> None:
    x = case.inputs(requires_grad=True)
    grads = input_grads(chunk_gated_delta_rule, x, case)
    expected = input_grads(ours_recurrent, x, case)
    for name, grad in grads.items():
        assert_close(name, grad, expected[name], FP64_GRAD_TOL[name])


@pytest.mark.parametrize("l2norm", [True, False], ids=["l2", "unitqk"])
def test_gradcheck(l2norm: bool) -> None:
    """Numerical against analytic gradients of o and the final state, several chunks plus padding."""
    case = Case(Shape(B=1, T=7, H=2, Hk=1, K=4, V=3), 3, torch.float64, True, l2norm)
    x = case.inputs(requires_grad=True)

    def fn(*args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        q, k, v, g, beta, s0 = args
        return chunk_gated_delta_rule(
            q, k, v, g, beta,
            chunk_size=case.chunk_size,
            initial_state=s0,
            output_final_state=True,
            use_qk_l2norm_in_kernel=l2norm,
        )  # fmt: skip

    assert torch.autograd.gradcheck(fn, (*x.qkvgb(), x.initial_state))


def test_bf16_inputs() -> None:
    case = Case(Shape(B=2, T=75, H=4, Hk=2), 32)
    x32 = case.inputs()
    x16 = Inputs(*(t.to(torch.bfloat16) for t in x32.qkvgb()), x32.initial_state)
    o16, s16 = run(chunk_gated_delta_rule, x16, case)
    assert o16.dtype == torch.bfloat16
    assert s16.dtype == torch.float32, "states are kept in fp32"
    same = Inputs(*(t.float() for t in x16.qkvgb()), x32.initial_state)  # the bf16 values, in fp32
    o_same, s_same = run(chunk_gated_delta_rule, same, case)
    assert_close("o", o16, o_same, BF16_TOL["o_vs_same_inputs"])
    assert_close("final_state", s16, s_same, BF16_TOL["final_state_vs_same_inputs"])
    o32, _ = run(chunk_gated_delta_rule, x32, case)
    assert_close("o", o16, o32, BF16_TOL["o_vs_fp32_inputs"])


def _bad(shape: Shape, **replace: torch.Tensor) -> Inputs:
    x = make_inputs(shape, with_state=True)
    for name, value in replace.items():
        setattr(x, name, value)
    return x


BAD_INPUTS = {
    # g given per q/k head instead of per value head
    "g-shape": (
        _bad(Shape(B=2, T=10, H=4, Hk=2), g=torch.zeros(2, 10, 2)),
        r"g .*\(2, 10, 4\).*\(2, 10, 2\)",
    ),
    "beta-shape": (
        _bad(Shape(B=2, T=10, H=4), beta=torch.zeros(2, 9, 4)),
        r"beta .*\(2, 10, 4\).*\(2, 9, 4\)",
    ),
    "H-not-multiple-of-Hk": (_bad(Shape(B=1, T=10, H=4, Hk=3)), r"H=4.*Hk=3"),
    # [B, H, V, K] instead of [B, H, K, V]
    "initial-state-shape": (
        _bad(Shape(B=1, T=10, H=2, K=8, V=4), initial_state=torch.zeros(1, 2, 4, 8)),
        r"initial_state .*\(1, 2, 8, 4\).*\(1, 2, 4, 8\)",
    ),
    "v-length": (_bad(Shape(B=1, T=10, H=2), v=torch.zeros(1, 11, 2, 16)), r"v .*T=10.*\(1, 11, 2, 16\)"),
}


@pytest.mark.parametrize("fn", [chunk_gated_delta_rule, ours_recurrent], ids=["chunk", "recurrent"])
@pytest.mark.parametrize("bad", list(BAD_INPUTS))
def test_bad_inputs_name_the_shapes(bad: str, fn: Callable) -> None:
    x, message = BAD_INPUTS[bad]
    with pytest.raises(ValueError, match=message):
        fn(*x.qkvgb(), chunk_size=16, initial_state=x.initial_state)


@pytest.mark.parametrize("chunk_size", [0, -4])
def test_bad_chunk_size(chunk_size: int) -> None:
    x = make_inputs(Shape(B=1, T=10, H=2))
    with pytest.raises(ValueError, match=rf"chunk_size.*{chunk_size}"):
        chunk_gated_delta_rule(*x.qkvgb(), chunk_size=chunk_size)
