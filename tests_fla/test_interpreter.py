"""fla's Triton kernels under Triton's interpreter (the fixture of conftest.py) equal our kernel:
the chunk kernel forward and backward (grouped value heads, an initial and a final state, packed
documents), the fused recurrent decode step, and bf16; and the fixture is undone after use."""

from __future__ import annotations

import torch
from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_recurrent
from oracles import rel_err
from triton_interpreter import interpreted_triton, patched_names

from hyperpar_gdn.ops import chunk_gated_delta_rule, recurrent_gated_delta_rule

T, HK, H, K, V = 40, 1, 2, 32, 32  # 40 tokens: not a multiple of the chunk (64)


def _inputs(seed: int, *, batch: int = 1, tokens: int = T, dtype: torch.dtype = torch.float32) -> list:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k = randn(batch, tokens, HK, K), randn(batch, tokens, HK, K)
    v = randn(batch, tokens, H, V)
    g = -0.05 * torch.rand(batch, tokens, H, generator=gen, dtype=torch.float64)
    beta = torch.rand(batch, tokens, H, generator=gen, dtype=torch.float64)
    h0 = randn(batch, H, K, V)
    return [x.to(dtype) for x in (q, k, v)] + [g.float(), beta.to(dtype), h0.float()]


def _run(rule, leaves: list, cot: torch.Tensor, cot_s: torch.Tensor, **kwargs) -> dict:
    leaves = [x.clone().requires_grad_(True) for x in leaves]
    q, k, v, g, beta, h0 = leaves
    o, s = rule(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, **kwargs
    )
    ((o.float() * cot).sum() + (s * cot_s).sum()).backward()
    names = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
    return {"o": o.detach(), "s": s.detach()} | {n: x.grad for n, x in zip(names, leaves, strict=True)}


def test_chunk_kernel_forward_backward_equals_ours() -> None:
    leaves = _inputs(0)
    cot, cot_s = torch.randn(1, T, H, V), torch.randn(1, H, K, V)
    fla = _run(fla_chunk, leaves, cot, cot_s)
    ours = _run(chunk_gated_delta_rule, leaves, cot, cot_s)
    for name, value in ours.items():
        assert rel_err(fla[name], value) < 1e-5, (name, rel_err(fla[name], value))


def test_chunk_kernel_packed_documents_equals_ours() -> None:
    q, k, v, g, beta, _ = _inputs(1)
    cu = torch.tensor([0, 7, 30, T])
    h0 = torch.randn(3, H, K, V)
    cot, cot_s = torch.randn(1, T, H, V), torch.randn(3, H, K, V)
    fla = _run(fla_chunk, [q, k, v, g, beta, h0], cot, cot_s, cu_seqlens=cu)
    ours = _run(chunk_gated_delta_rule, [q, k, v, g, beta, h0], cot, cot_s, cu_seqlens=cu)
    for name, value in ours.items():
        assert rel_err(fla[name], value) < 1e-5, (name, rel_err(fla[name], value))


def test_recurrent_step_equals_ours() -> None:
    q, k, v, g, beta, h0 = _inputs(2, batch=3, tokens=1)
    o, s = fla_recurrent(
        q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    o_ref, s_ref = recurrent_gated_delta_rule(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    assert rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5


def test_bf16_error_is_bf16_sized() -> None:
    """bf16 through the interpreter (the fixture's third workaround): against our fp64 kernel the
    error is bf16's (~1e-2 or less), not the uint16 bit patterns multiplied as integers."""
    exact = _inputs(3, dtype=torch.float64)
    exact[3], exact[5] = exact[3].double(), exact[5].double()
    o_ref, s_ref = chunk_gated_delta_rule(
        *exact[:5], initial_state=exact[5], output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    q, k, v, g, beta, h0 = _inputs(3, dtype=torch.bfloat16)
    o, s = fla_chunk(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert rel_err(o, o_ref) < 2e-2 and rel_err(s, s_ref) < 2e-2, (rel_err(o, o_ref), rel_err(s, s_ref))


def test_fixture_is_undone_after_use() -> None:
    """Entered again inside the test's own fixture: everything it replaced is back on exit."""
    outer = patched_names()
    with interpreted_triton():
        inner = patched_names()
    after = patched_names()
    assert after == outer
    assert all(inner[name] is not outer[name] for name in outer), [n for n in outer if inner[n] is outer[n]]
