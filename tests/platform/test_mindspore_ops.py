"""MindSporeOps against TorchOps: each tensor function, then every public GDN op end to end.

The same float64 numpy inputs go to torch and to MindSpore (cast to the dtype under test); each
side computes the outputs and the gradients of one random weighted sum of them with respect to
every input. MindSpore must match torch to TOL (max abs difference over the reference's max abs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import pytest
import torch

ms = pytest.importorskip("mindspore")
mint = ms.mint

from hyperpar_gdn.ops import (  # noqa: E402
    apply_summary,
    chunk_gated_delta_rule,
    compose_summaries,
    gdn_state_summary,
    recurrent_gated_delta_rule,
)
from hyperpar_gdn.platform import TensorOps, ops_for  # noqa: E402
from hyperpar_gdn.platform.mindspore_ops import MindSporeOps  # noqa: E402
from hyperpar_gdn.platform.torch_ops import TorchOps  # noqa: E402

DTYPES = ("float32", "float64")
# max |ms - torch| / max |torch|, outputs and gradients. Measured: <= 4e-7 (fp32) and 2e-15 (fp64)
# on every case here; MindSpore's own float32 exp kernel alone would make it 3e-6 (see below).
TOL = {"float32": 2e-6, "float64": 1e-10}
TORCH_DTYPE = {"float32": torch.float32, "float64": torch.float64}
MS_DTYPE = {"float32": ms.float32, "float64": ms.float64}

MS_OPS = MindSporeOps()
TORCH_OPS = TorchOps()


pytestmark = pytest.mark.usefixtures("mindspore_pynative")


# --- helpers ------------------------------------------------------------------------------------


def to_numpy(x: Any) -> np.ndarray:
    return x.detach().numpy() if isinstance(x, torch.Tensor) else x.asnumpy()


def assert_close(name: str, actual: Any, expected: Any, dtype: str) -> None:
    """MindSpore ``actual`` equals torch ``expected`` in shape, dtype and value (to TOL[dtype])."""
    a, e = to_numpy(actual), to_numpy(expected)
    assert a.shape == e.shape, f"{name}: shape {a.shape} != torch {e.shape}"
    assert a.dtype == e.dtype, f"{name}: dtype {a.dtype} != torch {e.dtype}"
    scale = max(float(np.abs(e).max(initial=0.0)), 1e-30)
    err = float(np.abs(a.astype(np.float64) - e.astype(np.float64)).max(initial=0.0)) / scale
    assert err <= TOL[dtype], f"{name}: max error {err:.3g} of scale {scale:.3g} > {TOL[dtype]:g} ({dtype})"


def flat_outputs(out: Any) -> list[Any]:
    """The tensors of an output that may be a tensor or (nested) tuples holding None."""
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in flat_outputs(o)]
    return [] if out is None else [out]


Run = tuple[list[Any], Sequence[Any] | None]  # outputs, and input gradients when weights are given


def torch_run(
    fn: Callable, arrays: Sequence[np.ndarray], dtype: str, weights: Sequence[np.ndarray] | None
) -> Run:
    xs = [torch.tensor(a, dtype=TORCH_DTYPE[dtype], requires_grad=True) for a in arrays]
    outs = flat_outputs(fn(*xs))
    if weights is None:
        return outs, None
    loss = sum((o * torch.tensor(w, dtype=o.dtype)).sum() for o, w in zip(outs, weights, strict=True))
    grads = torch.autograd.grad(loss, xs, allow_unused=True)  # a summary does not depend on q
    return outs, [torch.zeros_like(x) if g is None else g for x, g in zip(xs, grads, strict=True)]


def ms_run(
    fn: Callable, arrays: Sequence[np.ndarray], dtype: str, weights: Sequence[np.ndarray] | None
) -> Run:
    xs = [ms.tensor(a, dtype=MS_DTYPE[dtype]) for a in arrays]
    if weights is None:
        return flat_outputs(fn(*xs)), None

    def loss(*inputs: Any) -> tuple[Any, tuple[Any, ...]]:
        outs = flat_outputs(fn(*inputs))
        total = sum((o * ms.tensor(w, dtype=o.dtype)).sum() for o, w in zip(outs, weights, strict=True))
        return total, tuple(outs)

    grad_fn = ms.value_and_grad(loss, grad_position=tuple(range(len(xs))), has_aux=True)
    (_, outs), grads = grad_fn(*xs)
    return list(outs), (grads if isinstance(grads, tuple) else (grads,))


def compare(
    torch_fn: Callable,
    ms_fn: Callable,
    arrays: Sequence[np.ndarray],
    names: Sequence[str],
    dtype: str,
    *,
    seed: int = 1,
) -> None:
    """Run both sides on the same inputs; assert that the outputs and the input gradients match."""
    ref_outs, _ = torch_run(torch_fn, arrays, dtype, None)
    assert ref_outs, "the function under test returned no tensor"
    rng = np.random.default_rng(seed)
    weights = [rng.standard_normal(tuple(o.shape)) for o in ref_outs]
    ref_outs, ref_grads = torch_run(torch_fn, arrays, dtype, weights)
    outs, grads = ms_run(ms_fn, arrays, dtype, weights)
    assert len(outs) == len(ref_outs), f"{len(outs)} outputs, torch gives {len(ref_outs)}"
    for i, (o, r) in enumerate(zip(outs, ref_outs, strict=True)):
        assert_close(f"output {i}", o, r, dtype)
    assert grads is not None and ref_grads is not None
    assert len(grads) == len(arrays), f"{len(grads)} gradients for {len(arrays)} inputs"
    for name, g, r in zip(names, grads, ref_grads, strict=True):
        assert_close(f"d{name}", g, r, dtype)


# --- each tensor function -----------------------------------------------------------------------


def _float64(xp: TensorOps) -> Any:
    return torch.float64 if xp.name == "torch" else ms.float64


def _float16(xp: TensorOps) -> Any:
    return torch.float16 if xp.name == "torch" else ms.float16


@dataclass(frozen=True)
class OpCase:
    id: str
    fn: Callable[..., Any]  # fn(xp, *tensors)
    shapes: tuple[tuple[int, ...], ...]
    positive: bool = False  # inputs in [0.5, 1.5) instead of standard normal


OP_CASES = [
    OpCase("exp", lambda xp, x: xp.exp(x), ((3, 5),)),
    OpCase("rsqrt", lambda xp, x: xp.rsqrt(x), ((3, 5),), positive=True),
    OpCase("sigmoid", lambda xp, x: xp.sigmoid(x), ((3, 5),)),
    OpCase("softplus", lambda xp, x: xp.softplus(x), ((3, 5),)),
    OpCase("softplus-tails", lambda xp, x: xp.softplus(x * xp.scalar(25.0, x)), ((4, 8),)),
    OpCase("silu", lambda xp, x: xp.silu(x), ((3, 5),)),
    # MindSpore on CPU tiles the broadcast side first
    OpCase("mul-same-shape", lambda xp, a, b: xp.mul(a, b), ((2, 3, 4), (2, 3, 4))),
    OpCase("mul-broadcast-last", lambda xp, a, b: xp.mul(a, b), ((2, 3, 4, 5), (2, 3, 4, 1))),
    OpCase("mul-broadcast-both", lambda xp, a, b: xp.mul(a, b), ((3, 1, 5), (3, 4, 1))),
    OpCase("mul-lower-rank", lambda xp, a, b: xp.mul(a, b), ((4, 1), (2, 3, 4, 5))),
    OpCase("mul-0d", lambda xp, a, b: xp.mul(a, b.reshape(())), ((2, 3), (1,))),
    OpCase("sub-broadcast-last", lambda xp, a, b: xp.sub(a, b), ((2, 3, 4, 5), (2, 3, 4, 1))),
    OpCase("sub-broadcast-both", lambda xp, a, b: xp.sub(a, b), ((3, 1, 5), (3, 4, 1))),
    OpCase("sub-lower-rank", lambda xp, a, b: xp.sub(a, b), ((4, 1), (2, 3, 4, 5))),
    OpCase("sum-dim-1", lambda xp, x: xp.sum(x, -1), ((2, 3, 4),)),
    OpCase("sum-dims-keepdim", lambda xp, x: xp.sum(x, (-2, -1), keepdim=True), ((2, 3, 4),)),
    # MindSpore on CPU sums contiguous dims as a product with ones; views and gaps use its kernel
    OpCase("sum-middle-dim", lambda xp, x: xp.sum(x, 1, keepdim=True), ((2, 5, 3, 4),)),
    OpCase("sum-middle-dims", lambda xp, x: xp.sum(x, (1, 2)), ((2, 5, 3, 4),)),
    OpCase("sum-dims-with-gap", lambda xp, x: xp.sum(x, (0, 2)), ((2, 5, 3),)),
    OpCase("sum-transposed-view", lambda xp, x: xp.sum(xp.swapaxes(x, -1, -2), -1), ((3, 4, 5),)),
    OpCase("cumsum-dim1", lambda xp, x: xp.cumsum(x, 1), ((2, 6, 3),)),
    OpCase("softmax-last", lambda xp, x: xp.softmax(x, -1), ((2, 3, 5),)),
    # the mask picks 2 of 5 per row (no gradient through it); the product carries the gradient
    OpCase("top-k-mask", lambda xp, x: x * xp.cast(xp.top_k_mask(x, 2), xp.dtype(x)), ((3, 5),)),
    OpCase("swapaxes", lambda xp, x: xp.swapaxes(x, -1, -2) * 1, ((2, 3, 4),)),
    OpCase("permute", lambda xp, x: xp.permute(x, (2, 0, 3, 1)), ((2, 3, 4, 5),)),
    # the last dim stays (MindSpore on CPU: one row gather, its gradient the inverse gather)
    OpCase("permute-rows", lambda xp, x: xp.permute(x, (1, 0, 3, 2, 4)), ((2, 6, 3, 4, 5),)),
    OpCase("permute-rows-of-view", lambda xp, x: xp.permute(x[:, 1:], (1, 0, 2)), ((2, 4, 3),)),
    OpCase("cat-last", lambda xp, x, y: xp.cat([x, y], -1), ((2, 3), (2, 5))),
    OpCase("stack-dim0", lambda xp, x, y, z: xp.stack([x, y, z], 0), ((2, 3),) * 3),
    OpCase("stack-dim1", lambda xp, x, y: xp.stack([x, y], 1), ((2, 3),) * 2),
    OpCase("pad-dim1-after", lambda xp, x: xp.pad_dim(x, 1, 0, 3), ((2, 4, 3, 2),)),
    OpCase("pad-dim-1-both", lambda xp, x: xp.pad_dim(x, -1, 2, 1), ((2, 3),)),
    OpCase("pad-none", lambda xp, x: xp.pad_dim(x, 0, 0, 0), ((2, 3),)),
    OpCase("repeat-interleave-3", lambda xp, x: xp.repeat_interleave(x, 3, 2), ((2, 3, 2, 4),)),
    OpCase("repeat-interleave-1", lambda xp, x: xp.repeat_interleave(x, 1, 2), ((2, 3, 2, 4),)),
    OpCase("matmul-batched", lambda xp, a, b: xp.matmul(a, b), ((2, 3, 4, 5), (2, 3, 5, 6))),
    OpCase("matmul-broadcast", lambda xp, a, b: xp.matmul(a, b), ((2, 3, 4, 5), (5, 2))),
    OpCase(
        "matmul-transposed", lambda xp, a, b: xp.matmul(xp.swapaxes(a, -1, -2), b), ((3, 5, 4), (3, 5, 2))
    ),
    # MindSpore on CPU reads transposed views through (Batch)MatMul's transpose flags
    OpCase(
        "matmul-both-transposed-2d",
        lambda xp, a, b: xp.matmul(xp.swapaxes(a, -1, -2), xp.swapaxes(b, -1, -2)),
        ((5, 4), (3, 5)),
    ),
    OpCase(
        "matmul-b-transposed-5d",
        lambda xp, a, b: xp.matmul(a, xp.swapaxes(b, -1, -2)),
        ((3, 1, 2, 4, 6), (3, 1, 2, 5, 6)),
    ),
    OpCase(
        "matmul-swapped-middle-view",  # not a last-two-dims transpose: the plain kernel
        lambda xp, a, b: xp.matmul(xp.swapaxes(a, 0, 1), b),
        ((3, 2, 4, 5), (2, 3, 5, 6)),
    ),
    OpCase("tril", lambda xp, x: xp.tril(x), ((2, 5, 5),)),
    OpCase("tril-1", lambda xp, x: xp.tril(x, -1), ((2, 3, 5, 5),)),
    OpCase("tril+1", lambda xp, x: xp.tril(x, 1), ((4, 6),)),
    # a's diagonal and upper part must be ignored, values and gradients alike
    OpCase(
        "solve-unit-lower",
        lambda xp, a, b: xp.solve_unit_lower(a * xp.scalar(0.3, a), b),
        ((2, 3, 7, 7), (2, 3, 7, 5)),
    ),
    OpCase("linear", lambda xp, x, w: xp.linear(x, w), ((2, 3, 4), (6, 4))),
    OpCase("conv1d-halo", lambda xp, x, w: xp.depthwise_conv1d(x, w, left_pad=3), ((2, 5, 9), (5, 4))),
    OpCase("conv1d-nopad", lambda xp, x, w: xp.depthwise_conv1d(x, w, left_pad=0), ((1, 3, 8), (3, 4))),
    OpCase("scalar-times", lambda xp, x: x * xp.scalar(0.1, x), ((3,),)),
    OpCase("eye-plus-zeros", lambda xp, x: x + xp.eye(4, x) + xp.zeros((2, 4, 4), x), ((2, 4, 4),)),
    OpCase("cast-to-float64", lambda xp, x: xp.cast(x, _float64(xp)) * 2, ((3,),)),
    OpCase("cast-to-float16-and-back", lambda xp, x: xp.cast(xp.cast(x, _float16(xp)), xp.dtype(x)), ((3,),)),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", OP_CASES, ids=[c.id for c in OP_CASES])
def test_tensor_op_matches_torch(case: OpCase, dtype: str) -> None:
    rng = np.random.default_rng(0)
    arrays = [rng.random(s) + 0.5 if case.positive else rng.standard_normal(s) for s in case.shapes]
    names = [f"x{i}" for i in range(len(arrays))]
    compare(partial(case.fn, TORCH_OPS), partial(case.fn, MS_OPS), arrays, names, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dtypes_and_creation(dtype: str) -> None:
    x = ms.tensor(np.ones((2, 3)), dtype=MS_DTYPE[dtype])
    assert MS_OPS.is_tensor(x) and not MS_OPS.is_tensor(np.ones(3)) and not MS_OPS.is_tensor(torch.ones(3))
    assert ops_for(x) is ops_for(x * 2) and isinstance(ops_for(x), MindSporeOps)
    assert MS_OPS.dtype(x) == MS_DTYPE[dtype]
    assert MS_OPS.compute_dtype(x) == MS_DTYPE[dtype]
    assert MS_OPS.compute_dtype(x.astype(ms.float16)) == ms.float32
    assert MS_OPS.cast(x, ms.float16).dtype == ms.float16
    zeros = MS_OPS.zeros((2, 5), like=x)
    assert zeros.shape == (2, 5) and zeros.dtype == x.dtype and not zeros.asnumpy().any()
    eye = MS_OPS.eye(3, like=x)
    assert eye.dtype == x.dtype and np.array_equal(eye.asnumpy(), np.eye(3))
    # A Python float would be rounded to float32; the scalar keeps the input's precision.
    third = MS_OPS.scalar(1 / 3, like=x)
    assert third.shape == () and third.dtype == x.dtype
    assert float(third.asnumpy()) == float(np.array(1 / 3, dtype=dtype))
    assert float((x * third).asnumpy()[0, 0]) == float(np.array(1 / 3, dtype=dtype))


ACCURACY_CASES = {  # op, reference in float64 numpy, inputs
    "exp": (lambda xp, x: xp.exp(x), np.exp, np.linspace(-30.0, 10.0, 20001)),
    "sigmoid": (lambda xp, x: xp.sigmoid(x), lambda x: 1 / (1 + np.exp(-x)), np.linspace(-30.0, 30.0, 20001)),
    "softplus": (lambda xp, x: xp.softplus(x), lambda x: np.logaddexp(0, x), np.linspace(-30.0, 19.0, 20001)),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(ACCURACY_CASES))
def test_elementwise_accuracy(name: str, dtype: str) -> None:
    """Every element within a few float32 (or float64) roundings of the truth, as torch is: the CPU
    float32 kernels of exp and sigmoid are off by up to 5e-6 and 3e-6, softplus is 0 below -15.9."""
    op, reference, x = ACCURACY_CASES[name]
    x = x.astype(dtype)
    expected = reference(x.astype(np.float64))
    rel_tol = {"float32": 4 * 2.0**-24, "float64": 8 * 2.0**-53}[dtype]
    for side, xp, tensor in (("torch", TORCH_OPS, torch.tensor(x)), ("mindspore", MS_OPS, ms.tensor(x))):
        actual = to_numpy(op(xp, tensor)).astype(np.float64)
        worst = float((np.abs(actual - expected) / expected).max())
        assert worst <= rel_tol, f"{side} {name}: relative error {worst:.3g} > {rel_tol:.3g} ({dtype})"


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_exp_accuracy(dtype: str) -> None:
    """The softmax's exp (shifted scores, x <= 0, so exp(x) <= 1 = the row maximum's) may take
    MindSpore's float32 CPU kernel: within 4e-6 absolute (measured 2.3e-6; relative 3e-6 near 0,
    1e-5 near -30, some tiny values below -30 flushed to 0) in float32; a few roundings in float64."""
    x = np.linspace(-88.0, 0.0, 40001).astype(dtype)
    expected = np.exp(x.astype(np.float64))
    tol = {"float32": 4e-6, "float64": 8 * 2.0**-53}[dtype]
    for side, xp, tensor in (("torch", TORCH_OPS, torch.tensor(x)), ("mindspore", MS_OPS, ms.tensor(x))):
        worst = float(np.abs(to_numpy(xp.softmax_exp(tensor)).astype(np.float64) - expected).max())
        assert worst <= tol, f"{side}: absolute error {worst:.3g} > {tol:.3g} ({dtype})"


def test_cpu_fast_routes_are_taken_and_match_the_plain_kernels() -> None:
    """On CPU, MindSporeOps takes its faster routes (module docstring) where they apply: a row
    gather for permute, (Batch)MatMul's transpose flags for transposed views, products with ones
    for sums, tiling for broadcast products; each equals MindSpore's plain kernel."""
    xp = MindSporeOps("CPU")
    rng = np.random.default_rng(5)
    x = ms.tensor(rng.standard_normal((3, 4, 5, 6)), dtype=ms.float32)
    plain = x.permute(1, 0, 2, 3).contiguous()
    np.testing.assert_array_equal(xp.permute(x, (1, 0, 2, 3)).asnumpy(), plain.asnumpy())
    assert list(xp._row_orders) == [((3, 4, 5, 6), (1, 0, 2, 3))]
    a = ms.tensor(rng.standard_normal((3, 4, 6, 5)), dtype=ms.float32)
    b = ms.tensor(rng.standard_normal((3, 4, 7, 6)), dtype=ms.float32)
    fast = xp.matmul(a.swapaxes(-1, -2), b.swapaxes(-1, -2)).asnumpy()
    np.testing.assert_allclose(
        fast, mint.matmul(a.swapaxes(-1, -2), b.swapaxes(-1, -2)).asnumpy(), rtol=1e-6, atol=1e-5
    )
    assert list(xp._matmul_prims) == [(True, True, True)]
    np.testing.assert_allclose(xp.sum(x, 1).asnumpy(), x.sum(axis=1).asnumpy(), rtol=1e-6, atol=1e-6)
    assert list(xp._ones) == [((3, 1, 4), ms.float32)]
    y = ms.tensor(rng.standard_normal((4, 1, 6)), dtype=ms.float32)
    np.testing.assert_array_equal(xp.mul(x, y).asnumpy(), (x * y).asnumpy())
    np.testing.assert_array_equal(xp.sub(x, y).asnumpy(), (x - y).asnumpy())


def test_conv1d_float64_is_not_rounded_to_float32() -> None:
    x = ms.tensor(np.full((1, 1, 3), 1 / 3), dtype=ms.float64)
    w = ms.tensor(np.array([[1 / 7, 1 / 11]]), dtype=ms.float64)
    out = MS_OPS.depthwise_conv1d(x, w, left_pad=1).asnumpy()
    expected = np.array([1 / 3 / 11, 1 / 3 / 7 + 1 / 3 / 11, 1 / 3 / 7 + 1 / 3 / 11])
    assert out.dtype == np.float64 and np.abs(out[0, 0] - expected).max() < 1e-15


# --- custom_vjp ---------------------------------------------------------------------------------


def _vjp_forward(x: Any, y: Any) -> tuple[tuple[Any, Any], tuple[Any, ...]]:
    return (x * y, MS_OPS.exp(x)), (x, y)


def test_custom_vjp_uses_backward_and_zero_fills_none() -> None:
    calls: list[int] = []

    def backward(saved: tuple[Any, ...], d_prod: Any, d_exp: Any) -> tuple[Any, None]:
        x, y = saved
        calls.append(len(saved))
        return d_prod * y * 10 + d_exp, None  # deliberately not the true gradient of x

    def loss(x: Any, y: Any) -> Any:
        prod, _ = MS_OPS.custom_vjp(_vjp_forward, backward, x, y)  # the second output is unused
        return (prod * 2).sum()

    x = ms.tensor(np.array([0.5, -1.0, 2.0]), dtype=ms.float64)
    y = ms.tensor(np.array([3.0, 4.0, 5.0]), dtype=ms.float64)
    dx, dy = ms.grad(loss, grad_position=(0, 1))(x, y)
    assert calls == [2]
    np.testing.assert_array_equal(dx.asnumpy(), 2 * 10 * y.asnumpy())  # the unused output's grad is 0
    assert dy.shape == y.shape and dy.dtype == y.dtype and not dy.asnumpy().any()


def test_custom_vjp_single_output_and_no_grad() -> None:
    def forward(x: Any) -> tuple[tuple[Any], tuple[Any]]:
        return (x * x,), (x,)

    def backward(saved: tuple[Any, ...], d_square: Any) -> tuple[Any]:
        (x,) = saved
        return (d_square * x * 3,)

    x = ms.tensor(np.array([1.0, 2.0]), dtype=ms.float32)
    (square,) = MS_OPS.custom_vjp(forward, backward, x)  # outside any grad: a plain call
    np.testing.assert_array_equal(square.asnumpy(), np.array([1.0, 4.0], dtype=np.float32))
    dx = ms.grad(lambda t: MS_OPS.custom_vjp(forward, backward, t)[0].sum())(x)
    np.testing.assert_array_equal(dx.asnumpy(), np.array([3.0, 6.0], dtype=np.float32))


def test_custom_vjp_rejects_wrong_gradient_count() -> None:
    def backward(saved: tuple[Any, ...], d_prod: Any, d_exp: Any) -> tuple[Any]:
        return (d_prod,)

    def loss(x: Any, y: Any) -> Any:
        return MS_OPS.custom_vjp(_vjp_forward, backward, x, y)[0].sum()

    x = ms.tensor(np.ones(2), dtype=ms.float32)
    with pytest.raises((ValueError, RuntimeError), match="returned 1 gradients for 2 inputs"):
        ms.grad(loss, grad_position=(0, 1))(x, x * 2)


# --- the GDN ops end to end ---------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class GDNCase:
    b: int
    t: int
    hk: int  # query/key heads
    h: int  # value heads
    dk: int
    dv: int
    chunk_size: int | None = None  # None: the function's default (and the only choice for recurrent)
    initial_state: bool = False
    final_state: bool = False
    l2norm: bool = False

    @property
    def id(self) -> str:
        parts = [f"B{self.b}-T{self.t}-Hk{self.hk}-H{self.h}-K{self.dk}-V{self.dv}"]
        parts += [f"C{self.chunk_size}"] if self.chunk_size else []
        parts += [name for name in ("initial_state", "final_state", "l2norm") if getattr(self, name)]
        return "-".join(parts)

    @property
    def kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"use_qk_l2norm_in_kernel": self.l2norm}
        if self.chunk_size:
            kwargs["chunk_size"] = self.chunk_size
        return kwargs


def gdn_arrays(case: GDNCase, seed: int = 0) -> tuple[list[np.ndarray], list[str]]:
    """q, k, v, g, beta (and initial_state) with a stable recurrence: unit-norm k unless the op
    normalises it, g in [-0.1, -0.01) and beta in [0, 0.5), so that the M of a summary stays well
    above its rounding error (it is a difference of O(1) terms)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((case.b, case.t, case.hk, case.dk))
    k = rng.standard_normal((case.b, case.t, case.hk, case.dk))
    if not case.l2norm:
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((case.b, case.t, case.h, case.dv))
    g = -0.01 - 0.09 * rng.random((case.b, case.t, case.h))
    beta = 0.5 * rng.random((case.b, case.t, case.h))
    arrays, names = [q, k, v, g, beta], ["q", "k", "v", "g", "beta"]
    if case.initial_state:
        arrays.append(rng.standard_normal((case.b, case.h, case.dk, case.dv)))
        names.append("initial_state")
    return arrays, names


RULES = {"recurrent": recurrent_gated_delta_rule, "chunk": chunk_gated_delta_rule}
RULE_CASES = [
    (
        "recurrent",
        GDNCase(b=2, t=37, hk=1, h=2, dk=8, dv=6, initial_state=True, final_state=True, l2norm=True),
    ),
    ("recurrent", GDNCase(b=1, t=20, hk=2, h=2, dk=8, dv=8)),
    ("chunk", GDNCase(b=1, t=64, hk=2, h=2, dk=16, dv=16, chunk_size=16)),
    ("chunk", GDNCase(b=2, t=48, hk=2, h=2, dk=8, dv=8, chunk_size=16, initial_state=True, final_state=True)),
    ("chunk", GDNCase(b=2, t=45, hk=1, h=3, dk=8, dv=12, chunk_size=16, final_state=True, l2norm=True)),
    ("chunk", GDNCase(b=1, t=70, hk=2, h=4, dk=16, dv=16, initial_state=True, l2norm=True)),  # C=64
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rule", "case"), RULE_CASES, ids=[f"{r}-{c.id}" for r, c in RULE_CASES])
def test_gated_delta_rule_matches_torch(rule: str, case: GDNCase, dtype: str) -> None:
    arrays, names = gdn_arrays(case)
    fn = RULES[rule]

    def run(q: Any, k: Any, v: Any, g: Any, beta: Any, initial_state: Any = None) -> Any:
        return fn(
            q, k, v, g, beta, initial_state=initial_state, output_final_state=case.final_state, **case.kwargs
        )

    compare(run, run, arrays, names, dtype)


SUMMARY_CASES = [
    GDNCase(b=2, t=45, hk=1, h=2, dk=8, dv=6, chunk_size=16, l2norm=True),
    GDNCase(b=1, t=32, hk=2, h=2, dk=8, dv=8),  # one partial chunk of the default 64
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", SUMMARY_CASES, ids=[c.id for c in SUMMARY_CASES])
def test_state_summary_matches_torch(case: GDNCase, dtype: str) -> None:
    arrays, names = gdn_arrays(case)
    run = partial(gdn_state_summary, **case.kwargs)
    compare(run, run, arrays, names, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_compose_and_apply_summaries_match_torch(dtype: str) -> None:
    b, h, dk, dv = 2, 3, 6, 5
    rng = np.random.default_rng(3)
    shapes = [(b, h, dk, dv), (b, h, dk, dk), (b, h, dk, dv), (b, h, dk, dk), (b, h, dk, dv)]
    arrays = [rng.standard_normal(s) * 0.5 for s in shapes]

    def run(s1: Any, m1: Any, s2: Any, m2: Any, state: Any) -> Any:
        both = compose_summaries((s1, m1), (s2, m2))
        return both, apply_summary(both, state), apply_summary((s1, m1), state)

    compare(run, run, arrays, ["s_ext1", "m1", "s_ext2", "m2", "state"], dtype)
