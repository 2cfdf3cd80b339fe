"""State summaries (S_ext, M): their definition, the identities context parallelism relies on
(compose, apply, state passing between segments), gradients and dtypes."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from oracles import Inputs, Shape, assert_close, hf_chunk, l2norm, make_inputs

from hyperpar_gdn.ops import apply_summary, chunk_gated_delta_rule, compose_summaries, gdn_state_summary

# fp64 against fp64 (measured ~1e-15).
FP64_TOL = {"s_ext": 1e-12, "m": 1e-12, "o": 1e-12, "final_state": 1e-12}
# fp32 runs, or against transformers (fp32 inside); measured ~5e-7.
FP32_TOL = {"s_ext": 1e-5, "m": 1e-5, "final_state": 1e-5}

PROPERTY_SETTINGS = settings(max_examples=12, deadline=None, database=None)


def segment(x: Inputs, start: int, stop: int, initial_state: torch.Tensor | None = None) -> Inputs:
    """Tokens [start, stop) of x, entered with ``initial_state``."""
    q, k, v, g, beta = (t[:, start:stop] for t in x.qkvgb())
    return Inputs(q, k, v, g, beta, initial_state)


def summary(x: Inputs, chunk_size: int, l2: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    return gdn_state_summary(*x.qkvgb(), chunk_size=chunk_size, use_qk_l2norm_in_kernel=l2)


def final_state(x: Inputs, chunk_size: int, l2: bool = True) -> torch.Tensor:
    _, s = chunk_gated_delta_rule(
        *x.qkvgb(),
        chunk_size=chunk_size,
        initial_state=x.initial_state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=l2,
    )
    return s


def definition(x: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """M = A_T ... A_1 with A_t = exp(g_t)(I - beta_t k_t k_t^T), and S_ext = the state reached from
    zero, with explicit K x K matrices (in-kernel l2norm; q plays no part)."""
    b, t, hk, dk = x.k.shape
    h, dv = x.v.shape[2], x.v.shape[3]
    eye = torch.eye(dk, dtype=torch.float64)
    s_ext = torch.zeros(b, h, dk, dv, dtype=torch.float64)
    m = torch.zeros(b, h, dk, dk, dtype=torch.float64)
    for bi, hi in itertools.product(range(b), range(h)):
        s, prod = torch.zeros(dk, dv, dtype=torch.float64), eye
        for ti in range(t):
            k = l2norm(x.k[bi, ti, hi // (h // hk)])
            beta, v = x.beta[bi, ti, hi], x.v[bi, ti, hi]
            a = torch.exp(x.g[bi, ti, hi]) * (eye - beta * torch.outer(k, k))
            s, prod = a @ s + beta * torch.outer(k, v), a @ prod
        s_ext[bi, hi], m[bi, hi] = s, prod
    return s_ext, m


@pytest.mark.parametrize("t,chunk_size", [(1, 4), (9, 4), (40, 16)], ids=["T1-C4", "T9-C4", "T40-C16"])
def test_matches_definition_fp64(t: int, chunk_size: int) -> None:
    x = make_inputs(Shape(B=2, T=t, H=4, Hk=2, K=6, V=5), dtype=torch.float64, seed=t)
    s_ext, m = summary(x, chunk_size)
    s_ref, m_ref = definition(x)
    assert tuple(s_ext.shape) == (2, 4, 6, 5) and tuple(m.shape) == (2, 4, 6, 6)
    assert_close("s_ext", s_ext, s_ref, FP64_TOL["s_ext"])
    assert_close("m", m, m_ref, FP64_TOL["m"])


@pytest.mark.parametrize("chunk_size", [16, 64], ids=lambda c: f"C{c}")
@pytest.mark.parametrize("t", [63, 200], ids=lambda t: f"T{t}")
def test_matches_transformers(t: int, chunk_size: int) -> None:
    """S_ext is transformers' final state from zero; M is its final state from I with v = 0."""
    shape = Shape(B=2, T=t, H=4, Hk=2, K=16, V=16)
    x = make_inputs(shape, seed=t)
    s_ext, m = summary(x, chunk_size)
    _, s_ref = hf_chunk(
        *x.qkvgb(), chunk_size=chunk_size, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    eye = torch.eye(16).expand(2, 4, 16, 16)
    _, m_ref = hf_chunk(
        x.q, x.k, torch.zeros(2, t, 4, 16), x.g, x.beta,
        chunk_size=chunk_size, initial_state=eye, output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    assert_close("s_ext", s_ext, s_ref, FP32_TOL["s_ext"])
    assert_close("m", m, m_ref, FP32_TOL["m"])


APPLY_CASES = [
    (Shape(B=2, T=t, H=4, Hk=hk), c, dtype, l2)
    for (t, c), hk, dtype, l2 in itertools.product(
        ((1, 16), (75, 32), (200, 64)), (2, 4), (torch.float32, torch.float64), (True, False)
    )
    if t == 75 or (hk == 2 and l2)
]


@pytest.mark.parametrize(
    "shape,chunk_size,dtype,l2",
    APPLY_CASES,
    ids=[
        f"{s.id}-C{c}-{'fp32' if d == torch.float32 else 'fp64'}-{'l2' if l2 else 'unitqk'}"
        for s, c, d, l2 in APPLY_CASES
    ],
)
def test_apply_summary_is_the_final_state(
    shape: Shape, chunk_size: int, dtype: torch.dtype, l2: bool
) -> None:
    x = make_inputs(shape, dtype=dtype, seed=shape.T + 5, with_state=True, unit_qk=not l2)
    s_ext, m = summary(x, chunk_size, l2)
    assert s_ext.dtype == m.dtype == dtype
    tol = FP64_TOL if dtype == torch.float64 else FP32_TOL
    expected = final_state(x, chunk_size, l2)
    assert_close("final_state", apply_summary((s_ext, m), x.initial_state), expected, tol["final_state"])


@pytest.mark.parametrize("chunk_size", [1, 7, 32, 128])
def test_chunk_size_does_not_change_the_summary(chunk_size: int) -> None:
    x = make_inputs(Shape(B=1, T=75, H=2), dtype=torch.float64)
    s_ext, m = summary(x, chunk_size)
    s_ref, m_ref = summary(x, 64)
    assert_close("s_ext", s_ext, s_ref, FP64_TOL["s_ext"])
    assert_close("m", m, m_ref, FP64_TOL["m"])


def _check_compose(x: Inputs, split: int, chunk_size: int) -> None:
    first = summary(segment(x, 0, split), chunk_size)
    second = summary(segment(x, split, x.q.shape[1]), chunk_size)
    s_ext, m = compose_summaries(first, second)
    s_ref, m_ref = summary(x, chunk_size)
    assert_close("s_ext", s_ext, s_ref, FP64_TOL["s_ext"])
    assert_close("m", m, m_ref, FP64_TOL["m"])
    # Applying the composition is applying one summary after the other.
    s_in = x.initial_state
    assert_close(
        "final_state",
        apply_summary((s_ext, m), s_in),
        apply_summary(second, apply_summary(first, s_in)),
        FP64_TOL["final_state"],
    )


@pytest.mark.parametrize("split", [1, 31, 32, 33, 99])
def test_compose_at_split(split: int) -> None:
    x = make_inputs(Shape(B=2, T=100, H=4, Hk=2), dtype=torch.float64, seed=split, with_state=True)
    _check_compose(x, split, 32)


@PROPERTY_SETTINGS
@given(data=st.data(), t=st.integers(2, 150), chunk_size=st.sampled_from([1, 5, 16, 32, 64]))
def test_compose_at_random_split(data: st.DataObject, t: int, chunk_size: int) -> None:
    split = data.draw(st.integers(1, t - 1), label="split")
    x = make_inputs(Shape(B=1, T=t, H=2, K=8, V=8), dtype=torch.float64, seed=t, with_state=True)
    _check_compose(x, split, chunk_size)


@PROPERTY_SETTINGS
@given(data=st.data(), t=st.integers(2, 150), chunk_size=st.sampled_from([1, 5, 16, 32, 64]))
def test_state_passing_between_halves(data: st.DataObject, t: int, chunk_size: int) -> None:
    """First half from S_in, its final state into the second half: the whole sequence's outputs
    (concatenated) and final state."""
    split = data.draw(st.integers(1, t - 1), label="split")
    x = make_inputs(Shape(B=1, T=t, H=4, Hk=2, K=8, V=8), dtype=torch.float64, seed=t, with_state=True)
    kwargs = {"chunk_size": chunk_size, "output_final_state": True, "use_qk_l2norm_in_kernel": True}
    o1, s1 = chunk_gated_delta_rule(*segment(x, 0, split).qkvgb(), initial_state=x.initial_state, **kwargs)
    o2, s2 = chunk_gated_delta_rule(*segment(x, split, t).qkvgb(), initial_state=s1, **kwargs)
    o, s = chunk_gated_delta_rule(*x.qkvgb(), initial_state=x.initial_state, **kwargs)
    assert_close("o", torch.cat([o1, o2], 1), o, FP64_TOL["o"])
    assert_close("final_state", s2, s, FP64_TOL["final_state"])


@pytest.mark.parametrize(
    "dtype,summary_dtype",
    [(torch.float32, torch.float32), (torch.float64, torch.float64), (torch.bfloat16, torch.float32)],
    ids=["fp32", "fp64", "bf16"],
)
def test_summary_dtype(dtype: torch.dtype, summary_dtype: torch.dtype) -> None:
    """Summaries stay fp32 (fp64 for fp64 input) whatever the input dtype."""
    x = make_inputs(Shape(B=1, T=70, H=2), dtype=dtype)
    s_ext, m = summary(x, 32)
    assert s_ext.dtype == m.dtype == summary_dtype
    s_ref, m_ref = summary(Inputs(*(t.to(summary_dtype) for t in x.qkvgb()), None), 32)
    assert_close("s_ext", s_ext, s_ref, 0.0)
    assert_close("m", m, m_ref, 0.0)


def test_gradcheck() -> None:
    x = make_inputs(Shape(B=1, T=7, H=2, Hk=1, K=4, V=3), dtype=torch.float64, requires_grad=True)

    def fn(*args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return gdn_state_summary(*args, chunk_size=3, use_qk_l2norm_in_kernel=True)

    assert torch.autograd.gradcheck(fn, x.qkvgb())


@pytest.mark.parametrize(
    "replace,message",
    [
        ({"g": torch.zeros(1, 10, 2)}, r"g .*\(1, 10, 4\).*\(1, 10, 2\)"),
        ({"q": torch.zeros(1, 10, 3, 16), "k": torch.zeros(1, 10, 3, 16)}, r"H=4.*Hk=3"),
        ({"chunk_size": 0}, r"chunk_size.*0"),
    ],
    ids=["g-shape", "H-not-multiple-of-Hk", "chunk-size-0"],
)
def test_bad_inputs_name_the_shapes(replace: dict[str, Any], message: str) -> None:
    x = make_inputs(Shape(B=1, T=10, H=4, Hk=2))
    args = {"q": x.q, "k": x.k, "v": x.v, "g": x.g, "beta": x.beta, "chunk_size": 16} | replace
    with pytest.raises(ValueError, match=message):
        gdn_state_summary(
            args["q"], args["k"], args["v"], args["g"], args["beta"], chunk_size=args["chunk_size"]
        )
