"""Packed documents on MindSpore against torch on the same packed input: the new tensor functions,
the chunked rule (masked chunks and per-document states), the summary of a shard described by
doc_starts, and the GDN layer with cu_seqlens / position_ids. Outputs and every input gradient
(of one random weighted sum of the outputs) must match torch to TOL, relative to torch's largest
entry."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch

ms = pytest.importorskip("mindspore")

from hyperpar_gdn.models import GatedDeltaNet as TorchGatedDeltaNet  # noqa: E402
from hyperpar_gdn.models.mindspore import GatedDeltaNet  # noqa: E402
from hyperpar_gdn.ops import chunk_gated_delta_rule, gdn_state_summary  # noqa: E402
from hyperpar_gdn.platform.mindspore_ops import MindSporeOps  # noqa: E402
from hyperpar_gdn.platform.torch_ops import TorchOps  # noqa: E402

DTYPES = ("float32", "float64")
# As tests/platform/test_mindspore_ops.py; measured <= 3e-7 (fp32) and 8e-16 (fp64) on the ops here.
TOL = {"float32": 2e-6, "float64": 1e-10}
# The layer: fp32 as docs/maths.md's bound for layers (measured 6e-6 on dx, 1e-6 on the output);
# fp64 (measured ~1e-15).
LAYER_TOL = {"float32": 1e-4, "float64": 1e-10}
TORCH_DTYPE = {"float32": torch.float32, "float64": torch.float64}
MS_DTYPE = {"float32": ms.float32, "float64": ms.float64}
CU = (0, 1, 5, 16, 30, 31, 50)  # one-token document, a cut at a chunk start (C=16), T not a multiple


pytestmark = pytest.mark.usefixtures("mindspore_pynative")


def _np(x: Any) -> np.ndarray:
    return x.detach().numpy() if isinstance(x, torch.Tensor) else x.asnumpy()


def _check(name: str, actual: Any, expected: Any, tol: float) -> None:
    a, e = _np(actual).astype(np.float64), _np(expected).astype(np.float64)
    assert a.shape == e.shape, f"{name}: shape {a.shape} != torch {e.shape}"
    err = float(np.abs(a - e).max()) / max(float(np.abs(e).max()), 1e-30)
    assert err <= tol, f"{name}: error {err:.3g} > {tol:g}"


def _outputs(out: Any) -> list[Any]:
    return [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if o is not None]


def compare(fn: Callable[..., Any], arrays: Sequence[np.ndarray], dtype: str, tol: float) -> None:
    """``fn(*tensors)`` on torch and on MindSpore: outputs and input gradients of sum(out * w)."""
    xs = [torch.tensor(a, dtype=TORCH_DTYPE[dtype], requires_grad=True) for a in arrays]
    ref = _outputs(fn(*xs))
    rng = np.random.default_rng(1)
    weights = [rng.standard_normal(tuple(o.shape)) for o in ref]
    loss = sum((o * torch.tensor(w, dtype=o.dtype)).sum() for o, w in zip(ref, weights, strict=True))
    ref_grads = torch.autograd.grad(loss, xs)

    def ms_loss(*inputs: Any) -> tuple[Any, tuple[Any, ...]]:
        outs = _outputs(fn(*inputs))
        total = sum((o * ms.tensor(w, dtype=o.dtype)).sum() for o, w in zip(outs, weights, strict=True))
        return total, tuple(outs)

    grad_fn = ms.value_and_grad(ms_loss, grad_position=tuple(range(len(arrays))), has_aux=True)
    (_, outs), grads = grad_fn(*(ms.tensor(a, dtype=MS_DTYPE[dtype]) for a in arrays))
    grads = grads if isinstance(grads, tuple) else (grads,)
    for i, (o, r) in enumerate(zip(outs, ref, strict=True)):
        _check(f"output {i}", o, r, tol)
    for i, (g, r) in enumerate(zip(grads, ref_grads, strict=True)):
        _check(f"d input {i}", g, r, tol)


def _rule_inputs(t: int, *, states: int = 0) -> list[np.ndarray]:
    """q, k [1, T, 2, 8], v [1, T, 4, 8], g, beta [1, T, 4] (and states [N, 4, 8, 8])."""
    rng = np.random.default_rng(t)
    arrays = [
        rng.standard_normal((1, t, 2, 8)),
        rng.standard_normal((1, t, 2, 8)),
        rng.standard_normal((1, t, 4, 8)),
    ]
    arrays += [np.log(1 / (1 + np.exp(-(2 * rng.standard_normal((1, t, 4)) + 4)))), rng.random((1, t, 4))]
    if states:
        arrays.append(rng.standard_normal((states, 4, 8, 8)))
    return arrays


# --- the tensor functions added for packed documents ------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_take_constant_to_numpy(dtype: str) -> None:
    index = np.array([3, 0, 0, 2, 5])
    compare(
        lambda x: ops_of(x).take(x, index, 1) * 2,
        [np.random.default_rng(0).standard_normal((2, 6, 3))],
        dtype,
        TOL[dtype],
    )
    for xp, x in (
        (MindSporeOps(), ms.tensor(np.ones(2), dtype=MS_DTYPE[dtype])),
        (TorchOps(), torch.ones(2, dtype=TORCH_DTYPE[dtype])),
    ):
        c = xp.constant(np.array([[1, 0], [0, 1]], dtype=bool), like=x)
        assert xp.dtype(c) == xp.dtype(x)
        np.testing.assert_array_equal(xp.to_numpy(c), np.eye(2))


def ops_of(x: Any) -> Any:
    return TorchOps() if isinstance(x, torch.Tensor) else MindSporeOps()


# --- the rule -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_document_states", [False, True], ids=["masked-chunks", "document-aligned"])
def test_chunk_rule_with_cu_seqlens(per_document_states: bool, dtype: str) -> None:
    n = len(CU) - 1

    def fn(*x: Any) -> Any:
        cu = ms.tensor(CU) if isinstance(x[0], ms.Tensor) else torch.tensor(CU)
        if per_document_states:
            return chunk_gated_delta_rule(
                *x[:5], initial_state=x[5], output_final_state=True, chunk_size=16,
                cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
            )  # fmt: skip
        return chunk_gated_delta_rule(*x, chunk_size=16, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)

    compare(fn, _rule_inputs(CU[-1], states=n if per_document_states else 0), dtype, TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_summary_with_doc_starts(dtype: str) -> None:
    doc_starts = np.zeros(CU[-1], dtype=bool)
    doc_starts[list(CU[2:-1])] = True  # a shard that continues a document, then starts others

    def fn(*x: Any) -> Any:
        return gdn_state_summary(*x, chunk_size=16, use_qk_l2norm_in_kernel=True, doc_starts=doc_starts)

    compare(fn, _rule_inputs(CU[-1]), dtype, TOL[dtype])


# --- the layer ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("keyword", ["cu_seqlens", "position_ids"])
def test_layer_with_packed_documents(keyword: str, dtype: str) -> None:
    torch.manual_seed(0)
    torch_layer = TorchGatedDeltaNet(32, 2, 4, 16, 8)
    with torch.no_grad():
        for p in torch_layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    torch_layer = torch_layer.to(TORCH_DTYPE[dtype])
    ms_layer = GatedDeltaNet.from_torch(torch_layer)
    positions = np.concatenate([np.arange(b - a) for a, b in zip(CU[:-1], CU[1:], strict=True)])[None]

    def packed(tensor: Callable[[np.ndarray], Any]) -> dict[str, Any]:
        return (
            {"cu_seqlens": tensor(np.array(CU))}
            if keyword == "cu_seqlens"
            else {"position_ids": tensor(positions)}
        )

    x = np.random.default_rng(2).standard_normal((1, CU[-1], 32))
    cot = np.random.default_rng(3).standard_normal((1, CU[-1], 32))
    xt = torch.tensor(x, dtype=TORCH_DTYPE[dtype], requires_grad=True)
    out = torch_layer(xt, **packed(torch.tensor))
    (out * torch.tensor(cot, dtype=TORCH_DTYPE[dtype])).sum().backward()
    xm = ms.tensor(x, dtype=MS_DTYPE[dtype])

    def loss(inp: Any) -> Any:
        return (ms_layer(inp, **packed(ms.tensor)) * ms.tensor(cot, dtype=MS_DTYPE[dtype])).sum()

    ms_out = ms_layer(xm, **packed(ms.tensor))
    dx = ms.grad(loss)(xm)
    _check("output", ms_out, out, LAYER_TOL[dtype])
    _check("dx", dx, xt.grad, LAYER_TOL[dtype])
    # Guards the comparison: without the keyword the documents see each other.
    assert np.abs(_np(ms_layer(xm)) - _np(ms_out)).max() > 1e-4
