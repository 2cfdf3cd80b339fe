"""RMSNorm with its hand-written backward (the path MindSpore on CPU takes) against autograd:
transformers' Qwen3.5 norms (fp32), our autograd forms in float64 and bf16 on torch, and
MindSpore's written path against torch's autograd."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, Qwen3_5RMSNormGated

from hyperpar_gdn.ops.blocks import rms_norm
from hyperpar_gdn.ops.gdn.layer import gated_rms_norm
from hyperpar_gdn.ops.rms_norm_vjp import written_gated_rms_norm, written_rms_norm
from hyperpar_gdn.platform.torch_ops import TorchOps

SHAPE = (2, 5, 3, 16)  # [B, T, H, D]
EPS = 1e-6
XP = TorchOps()
KINDS = ("plain", "zero_centred", "gated")


def _inputs(dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    """x, gate [B, T, H, D] and weight [D] (near 1 for plain and gated, near 0 zero-centred)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(SHAPE, generator=gen, dtype=torch.float64) * 3
    gate = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    weight = torch.randn(SHAPE[-1], generator=gen, dtype=torch.float64) * 0.2
    return [t.to(dtype).requires_grad_() for t in (x, gate, weight)]


def _written(kind: str) -> Callable[..., Any]:
    if kind == "gated":
        return lambda xp, x, gate, w: written_gated_rms_norm(xp, x, gate, w, EPS)
    return lambda xp, x, gate, w: written_rms_norm(xp, x, w, EPS, zero_centred=kind == "zero_centred")


def _autograd(kind: str) -> Callable[..., Any]:
    if kind == "gated":
        return lambda xp, x, gate, w: gated_rms_norm(xp, x, gate, w, EPS)
    return lambda xp, x, gate, w: rms_norm(xp, x, w, EPS, zero_centred=kind == "zero_centred")


def _value_and_grads(fn: Callable[..., Any], inputs: list[torch.Tensor], kind: str) -> list[torch.Tensor]:
    """The output and the gradients of a fixed weighted sum of it (gate's only when gated)."""
    out = fn(*inputs)
    weights = torch.linspace(-1, 2, out.numel(), dtype=torch.float64).reshape(out.shape)
    used = inputs if kind == "gated" else [inputs[0], inputs[2]]
    grads = torch.autograd.grad((out.double() * weights).sum(), used)
    return [out.detach(), *grads]


def _max_rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.double(), expected.double()
    return float((a - e).abs().max() / e.abs().max())


@pytest.mark.parametrize("kind", KINDS)
def test_written_equals_transformers_norms_fp32(kind: str) -> None:
    """fp32, where transformers computes: Qwen3RMSNorm (plain), Qwen3_5RMSNorm (zero-centred),
    Qwen3_5RMSNormGated (gated), each with the same weight."""
    inputs = _inputs(torch.float32)
    module = {"plain": Qwen3RMSNorm, "zero_centred": Qwen3_5RMSNorm, "gated": Qwen3_5RMSNormGated}[kind](
        SHAPE[-1], eps=EPS
    )

    def theirs(x: torch.Tensor, gate: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        args = (x, gate) if kind == "gated" else (x,)
        return torch.func.functional_call(module, {"weight": w}, args)

    expected = _value_and_grads(theirs, inputs, kind)
    actual = _value_and_grads(lambda *a: _written(kind)(XP, *a), inputs, kind)
    for a, e in zip(actual, expected, strict=True):
        assert a.dtype == e.dtype
        assert _max_rel(a, e) < 2e-6, (kind, _max_rel(a, e))


@pytest.mark.parametrize("kind", KINDS)
def test_written_equals_autograd_forms_fp64(kind: str) -> None:
    inputs = _inputs(torch.float64)
    expected = _value_and_grads(lambda *a: _autograd(kind)(XP, *a), inputs, kind)
    actual = _value_and_grads(lambda *a: _written(kind)(XP, *a), inputs, kind)
    assert torch.equal(actual[0], expected[0])  # the same products in the same order
    for a, e in zip(actual[1:], expected[1:], strict=True):
        assert _max_rel(a, e) < 1e-13, (kind, _max_rel(a, e))


@pytest.mark.parametrize("kind", KINDS)
def test_written_keeps_dtypes_in_bf16(kind: str) -> None:
    """bf16 activations with fp32 weights (as under autocast): the same output bits and the
    gradients' dtypes of the autograd form, the gradients within bf16's rounding."""
    x, gate, weight = _inputs(torch.bfloat16)
    weight = weight.detach().float().requires_grad_()
    inputs = [x, gate, weight]
    expected = _value_and_grads(lambda *a: _autograd(kind)(XP, *a), inputs, kind)
    actual = _value_and_grads(lambda *a: _written(kind)(XP, *a), inputs, kind)
    assert torch.equal(actual[0], expected[0])
    for a, e in zip(actual[1:], expected[1:], strict=True):
        assert a.dtype == e.dtype
        assert _max_rel(a, e) < 2e-2, (kind, _max_rel(a, e))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("kind", KINDS)
def test_mindspore_takes_the_written_path_and_equals_torch(kind: str, dtype: str) -> None:
    ms = pytest.importorskip("mindspore")
    from hyperpar_gdn.platform.mindspore_ops import MindSporeOps

    xp = MindSporeOps(device_target="CPU")
    assert xp.prefers_written_backward
    torch_inputs = _inputs(getattr(torch, dtype))
    expected = _value_and_grads(lambda *a: _autograd(kind)(XP, *a), torch_inputs, kind)
    x, gate = (ms.Tensor(t.detach().numpy()) for t in torch_inputs[:2])
    weight = ms.Parameter(ms.Tensor(torch_inputs[2].detach().numpy()), name="weight")  # as in a cell
    out = _autograd(kind)(xp, x, gate, weight)
    weights = ms.Tensor(np.linspace(-1, 2, out.size).reshape(out.shape).astype(np.float64))
    positions = (0, 1) if kind == "gated" else 0

    def loss(x: Any, gate: Any) -> Any:
        return (_autograd(kind)(xp, x, gate, weight).astype(ms.float64) * weights).sum()

    input_grads, (weight_grad,) = ms.grad(loss, grad_position=positions, weights=[weight])(x, gate)
    input_grads = list(input_grads) if kind == "gated" else [input_grads]
    tol = 2e-6 if dtype == "float32" else 1e-12
    for a, e in zip([out, *input_grads, weight_grad], expected, strict=True):
        assert _max_rel(torch.tensor(a.asnumpy()), e) < tol, (kind, dtype)
