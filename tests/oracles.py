"""Gated delta rule references that no one in this project wrote, and the inputs tests feed them.

Oracles (all called as ``oracle(q, k, v, g, beta, *, chunk_size, initial_state, output_final_state,
use_qk_l2norm_in_kernel) -> (o, final_state)``, with g before beta):

- ``hf_chunk`` / ``hf_recurrent``: transformers' ``torch_chunk_gated_delta_rule`` and
  ``torch_recurrent_gated_delta_rule`` from ``models/qwen3_5/modeling_qwen3_5.py``, unwrapped from
  their kernel-hub decorator so the pure-torch code runs. They compute in fp32 whatever the input
  dtype, and return o in the input dtype.
- ``fla_chunk`` / ``fla_recurrent``: ``naive_chunk_gated_delta_rule`` and
  ``naive_recurrent_gated_delta_rule`` from fla's ``ops/gated_delta_rule/naive.py``, loaded by file
  path (importing ``fla.ops`` imports triton). They compute in fp32, neither l2-normalise nor
  repeat heads, and fla's recurrent one takes beta before g: the wrappers here do the l2norm
  (same formula and eps as ours and transformers') and the head repeat, fix the argument order
  and cast o back to the input dtype.

Final states come back as the oracle leaves them (fp32).

Legend: B batch, T tokens, Hk query/key heads, H value heads, K key dim, V value dim.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6
Oracle = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


@functools.cache
def transformers_raw_functions() -> tuple[Oracle, Oracle]:
    """(torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule), undecorated."""
    module = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
    return (
        inspect.unwrap(module.torch_chunk_gated_delta_rule),
        inspect.unwrap(module.torch_recurrent_gated_delta_rule),
    )


def fla_naive_path() -> Path:
    """Path of fla's ``ops/gated_delta_rule/naive.py``, found without importing fla."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the fla package (fla-core) is not installed")
    for location in spec.submodule_search_locations:
        path = Path(location) / "ops" / "gated_delta_rule" / "naive.py"
        if path.is_file():
            return path
    raise ImportError(f"no ops/gated_delta_rule/naive.py under {list(spec.submodule_search_locations)}")


@functools.cache
def fla_naive_module() -> ModuleType:
    """fla's naive.py as a standalone module (it needs only torch and einops)."""
    path = fla_naive_path()
    spec = importlib.util.spec_from_file_location("fla_gated_delta_rule_naive", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (fla's and transformers' formula)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def hf_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    chunk, _ = transformers_raw_functions()
    return chunk(
        q,
        k,
        v,
        g,
        beta,
        chunk_size=chunk_size,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
    )


def hf_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    chunk_size: int = 64,  # unused: same call shape as the chunked oracles
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    del chunk_size
    _, recurrent = transformers_raw_functions()
    return recurrent(
        q,
        k,
        v,
        g,
        beta,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
    )


def _fla_qk(
    q: torch.Tensor, k: torch.Tensor, num_v_heads: int, use_qk_l2norm_in_kernel: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Repeat q/k heads to the value heads (interleaved) and l2-normalise them if asked, in fp32
    as the other oracles do."""
    groups = num_v_heads // q.shape[2]
    q, k = (x.float().repeat_interleave(groups, dim=2) for x in (q, k))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    return q, k


def fla_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    out_dtype = q.dtype
    q, k = _fla_qk(q, k, v.shape[2], use_qk_l2norm_in_kernel)
    o, s = fla_naive_module().naive_chunk_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        chunk_size=chunk_size,
        initial_state=initial_state,
        output_final_state=output_final_state,
    )
    return o.to(out_dtype), s


def fla_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    chunk_size: int = 64,  # unused: same call shape as the chunked oracles
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    del chunk_size
    out_dtype = q.dtype
    q, k = _fla_qk(q, k, v.shape[2], use_qk_l2norm_in_kernel)
    o, s = fla_naive_module().naive_recurrent_gated_delta_rule(
        q,
        k,
        v,
        beta,  # fla's recurrent reference takes beta before g
        g,
        initial_state=initial_state,
        output_final_state=output_final_state,
    )
    return o.to(out_dtype), s


ORACLES: dict[str, Oracle] = {
    "hf_chunk": hf_chunk,
    "hf_recurrent": hf_recurrent,
    "fla_chunk": fla_chunk,
    "fla_recurrent": fla_recurrent,
}


# ---------------------------------------------------------------------------------------------
# Inputs and comparisons shared by the op tests.


@dataclass(frozen=True)
class Shape:
    B: int
    T: int
    H: int
    K: int = 16
    V: int = 16
    Hk: int | None = None  # None: as many q/k heads as value heads

    @property
    def hk(self) -> int:
        return self.H if self.Hk is None else self.Hk

    @property
    def id(self) -> str:
        gqa = "" if self.hk == self.H else f"-Hk{self.hk}"
        return f"B{self.B}-T{self.T}-H{self.H}{gqa}-K{self.K}-V{self.V}"


@dataclass
class Inputs:
    """q, k ``[B, T, Hk, K]``, v ``[B, T, H, V]``, g, beta ``[B, T, H]``, state ``[B, H, K, V]``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    initial_state: torch.Tensor | None

    def qkvgb(self) -> tuple[torch.Tensor, ...]:
        return self.q, self.k, self.v, self.g, self.beta

    def leaves(self) -> dict[str, torch.Tensor]:
        """The differentiable inputs by gradient name (dq, dk, ...)."""
        named = {"dq": self.q, "dk": self.k, "dv": self.v, "dg": self.g, "dbeta": self.beta}
        if self.initial_state is not None:
            named["dinitial_state"] = self.initial_state
        return named


def make_inputs(
    shape: Shape,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    with_state: bool = False,
    unit_qk: bool = False,
    requires_grad: bool = False,
) -> Inputs:
    """Random inputs shaped like a GDN layer's: g = logsigmoid(.) <= 0 with mostly slow decay (so
    the state carries across chunks), beta in (0, 1). ``unit_qk`` l2-normalises q and k, as the
    caller must when the kernel does not (otherwise the delta rule is unstable)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, dtype=torch.float64)

    b, t, hk, h = shape.B, shape.T, shape.hk, shape.H
    q, k = randn(b, t, hk, shape.K), randn(b, t, hk, shape.K)
    if unit_qk:
        q, k = l2norm(q), l2norm(k)
    v = randn(b, t, h, shape.V)
    g = F.logsigmoid(2.0 * randn(b, t, h) + 6.0)
    beta = torch.sigmoid(randn(b, t, h) - 1.0)
    s0 = randn(b, h, shape.K, shape.V) if with_state else None
    tensors = [x if x is None else x.to(dtype).requires_grad_(requires_grad) for x in (q, k, v, g, beta, s0)]
    return Inputs(*tensors)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (in fp64)."""
    a, e = actual.detach().double(), expected.detach().double()
    return ((a - e).abs().max() / e.abs().max().clamp_min(1e-30)).item()


def assert_close(name: str, actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    """Shapes equal, values finite and max abs error within ``tol`` of the expected tensor's scale."""
    assert tuple(actual.shape) == tuple(expected.shape), (
        f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    assert torch.isfinite(actual).all(), f"{name}: non-finite values"
    err = rel_err(actual, expected)
    assert err <= tol, f"{name}: error {err:.3g} relative to max|expected| exceeds {tol:.1g}"
