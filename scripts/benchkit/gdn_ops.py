"""The chunked gated delta rule as ``scripts/bench_ops.py`` times it: its configuration, the FLOP
count of the algorithm, and the torch backend (inputs, the implementations compared, timing calls,
matmul rates). The MindSpore backend is in :mod:`benchkit.gdn_ops_mindspore`.

Implementations (torch):
- ``ours``: :func:`hyperpar_gdn.ops.chunk_gated_delta_rule`, in-kernel l2norm.
- ``transformers``: the raw ``torch_chunk_gated_delta_rule`` of ``transformers`` (Qwen3.5).
- ``fla_naive``: ``naive_chunk_gated_delta_rule`` from fla's ``ops/gated_delta_rule/naive.py``,
  loaded by file path (``fla.ops`` imports triton). It does not l2-normalise, so its function
  l2-normalises q and k first (same formula and eps) inside the timed region, and its gradients
  are taken with respect to the raw q and k like the others'.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from benchkit.timing import median_time

__all__ = ["GRAD_NAMES", "BenchConfig", "TorchBackend", "chunk_gdn_flops", "matmul_rates"]

L2NORM_EPS = 1e-6
GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta")


@dataclass(frozen=True)
class BenchConfig:
    """One run of ``bench_ops``: shapes ``[B, T, H, K]`` / ``V``, chunk size, rounds, threads,
    backend, seed and the packed case's tokens and documents."""

    B: int
    T: int
    H: int
    K: int
    V: int
    chunk_size: int
    repeats: int
    warmup: int
    threads: int | None
    backend: str
    seed: int = 0
    packed_T: int = 8192
    packed_docs: int = 8
    keep_host_memory: bool = True


def chunk_gdn_flops(cfg: BenchConfig) -> dict[str, Any]:
    """Matmul-class FLOPs of one forward and one backward of the chunked algorithm in
    ``hyperpar_gdn/ops/gdn/chunk.py`` (preparation, with the explicit unit-lower inverse Tinv) and
    ``hyperpar_gdn/ops/gdn/recurrence.py`` (state recurrence), q/k heads already at H.

    A matmul [m, k] x [k, n] counts 2mkn; the unit-lower triangular solve against I (C right-hand
    sides) counts C^3 (C(C-1)/2 multiply-adds per column). Elementwise work (gates, masks, l2norm)
    is left out. Padding counts: T is rounded up to whole chunks."""
    c, dk, dv = cfg.chunk_size, cfg.K, cfg.V
    n_blocks = -(-cfg.T // c) * cfg.B * cfg.H  # chunks x batch x heads

    def mm(m: int, k: int, n: int) -> int:
        return 2 * m * k * n

    forward = {
        "prep: k k^T": mm(c, dk, c),
        "prep: q k^T": mm(c, dk, c),
        "prep: Tinv = solve(I + A, I)": c**3,
        "prep: u = Tinv (beta v)": mm(c, c, dv),
        "prep: w = Tinv (beta exp(G) k)": mm(c, c, dk),
        "loop: w_i S": mm(c, dk, dv),
        "loop: kd_i^T vn": mm(dk, c, dv),
        "out: qg S": mm(c, dk, dv),
        "out: P vn": mm(c, c, dv),
    }
    backward = {
        "out: P^T do": mm(c, c, dv),
        "out: qg^T do": mm(dk, c, dv),
        "loop: kd_i dS": mm(c, dk, dv),
        "loop: w_i^T dvn": mm(dk, c, dv),
        "loop: dw = dvn S^T": mm(c, dv, dk),
        "loop: dkd = vn dS^T": mm(c, dv, dk),
        "out: dqg = do S^T": mm(c, dv, dk),
        "out: dP = do vn^T": mm(c, dv, c),
        "prep: dv = (Tinv diag(beta))^T du": mm(c, c, dv),
        "prep: (Tinv diag(beta exp(G)))^T dw": mm(c, c, dk),
        "prep: d Tinv = du v^T, dw k^T": mm(c, dv, c) + mm(c, dk, c),
        "prep: dA = -Tinv^T dTinv Tinv^T": 2 * mm(c, c, c),
        "prep: dk from k k^T and q k^T": 2 * mm(c, c, dk),
        "prep: dq from q k^T": mm(c, c, dk),
    }
    fwd, bwd = sum(forward.values()) * n_blocks, sum(backward.values()) * n_blocks
    return {
        "forward": fwd,
        "backward": bwd,
        "forward_backward": fwd + bwd,
        "per_block_forward": forward,
        "per_block_backward": backward,
        "blocks": n_blocks,
    }


def _fla_naive_module() -> ModuleType:
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("fla (fla-core) is not installed")
    for location in spec.submodule_search_locations:
        path = Path(location) / "ops" / "gated_delta_rule" / "naive.py"
        if path.is_file():
            module_spec = importlib.util.spec_from_file_location("fla_gated_delta_rule_naive", path)
            assert module_spec is not None and module_spec.loader is not None
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
            return module
    raise ImportError("fla has no ops/gated_delta_rule/naive.py")


class TorchBackend:
    """Inputs, implementations, timing calls and matmul rates for PyTorch tensors."""

    name = "torch"

    def __init__(self, cfg: BenchConfig) -> None:
        import torch

        self.torch = torch
        if cfg.threads is not None:
            torch.set_num_threads(cfg.threads)
        self.cfg = cfg

    def info(self) -> dict[str, Any]:
        return {"torch": self.torch.__version__, "threads": self.torch.get_num_threads()}

    def make_inputs(self) -> dict[str, Any]:
        """q, k ``[B, T, H, K]``, v ``[B, T, H, V]``, g, beta ``[B, T, H]`` (fp32, leaves), and the
        cotangent ``do`` ``[B, T, H, V]``."""
        torch, cfg = self.torch, self.cfg
        gen = torch.Generator().manual_seed(cfg.seed)
        b, t, h = cfg.B, cfg.T, cfg.H

        def randn(*size: int) -> Any:
            return torch.randn(*size, generator=gen)

        tensors = {
            "q": randn(b, t, h, cfg.K),
            "k": randn(b, t, h, cfg.K),
            "v": randn(b, t, h, cfg.V),
            "g": torch.nn.functional.logsigmoid(2 * randn(b, t, h) + 4),  # log decay, mostly slow
            "beta": torch.sigmoid(randn(b, t, h)),
        }
        inputs = {name: x.requires_grad_(True) for name, x in tensors.items()}
        inputs["do"] = randn(b, t, h, cfg.V)
        return inputs

    def implementations(self) -> dict[str, Callable[[dict[str, Any]], Any]]:
        """name -> function of the inputs returning o ``[B, T, H, V]``."""
        from hyperpar_gdn.ops import chunk_gated_delta_rule

        hf_module = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
        hf_chunk = inspect.unwrap(hf_module.torch_chunk_gated_delta_rule)
        fla_chunk = _fla_naive_module().naive_chunk_gated_delta_rule
        c = self.cfg.chunk_size

        def ours(x: dict[str, Any]) -> Any:
            o, _ = chunk_gated_delta_rule(
                x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=c, use_qk_l2norm_in_kernel=True
            )
            return o

        def transformers(x: dict[str, Any]) -> Any:
            o, _ = hf_chunk(
                x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=c, use_qk_l2norm_in_kernel=True
            )
            return o

        def fla_naive(x: dict[str, Any]) -> Any:
            def l2norm(y: Any) -> Any:
                return y * self.torch.rsqrt((y * y).sum(-1, keepdim=True) + L2NORM_EPS)

            o, _ = fla_chunk(l2norm(x["q"]), l2norm(x["k"]), x["v"], x["g"], x["beta"], chunk_size=c)
            return o

        return {"ours": ours, "transformers": transformers, "fla_naive": fla_naive}

    def forward(self, fn: Callable, x: dict[str, Any]) -> Any:
        with self.torch.no_grad():
            return fn(x)

    def forward_backward(self, fn: Callable, x: dict[str, Any]) -> tuple[Any, list[Any]]:
        o = fn(x)
        leaves = [x[name[1:]] for name in GRAD_NAMES]
        grads = self.torch.autograd.grad(o, leaves, grad_outputs=x["do"])
        return o, list(grads)

    def to_numpy(self, x: Any) -> np.ndarray:
        return x.detach().double().cpu().numpy()

    def measured_flops(self, fn: Callable, x: dict[str, Any]) -> int:
        """Matmul FLOPs of one forward+backward as torch's FlopCounterMode sees them (it does not
        count the triangular solve)."""
        from torch.utils.flop_counter import FlopCounterMode

        with FlopCounterMode(display=False) as counter:
            self.forward_backward(fn, x)
        return int(counter.get_total_flops())

    def matmul_rates(self, size: int, repeats: int) -> dict[str, Any]:
        """:func:`matmul_rates` with torch's matmul."""
        return matmul_rates(self.cfg, self.torch.matmul, self.torch.randn, size=size, repeats=repeats)


def matmul_rates(
    cfg: BenchConfig, matmul: Callable[[Any, Any], Any], randn: Callable[..., Any], *, size: int, repeats: int
) -> dict[str, Any]:
    """GFLOP/s of one [size, size] x [size, size] fp32 matmul, and of the batched
    [H, C, K] x [H, K, V] matmuls the state recurrence issues (timed 100 at a time), with the
    framework's ``matmul`` and ``randn(*shape)``."""
    a, b = randn(size, size), randn(size, size)
    large = median_time(lambda: matmul(a, b), repeats=repeats, warmup=1)
    sa, sb = randn(cfg.H, cfg.chunk_size, cfg.K), randn(cfg.H, cfg.K, cfg.V)
    calls = 100

    def small_batch() -> None:
        for _ in range(calls):
            matmul(sa, sb)

    small = median_time(small_batch, repeats=repeats, warmup=1) / calls
    small_flops = 2 * cfg.H * cfg.chunk_size * cfg.K * cfg.V
    return {
        "large_shape": [size, size, size],
        "large_seconds": large,
        "large_gflops": 2 * size**3 / large / 1e9,
        "small_shape": [[cfg.H, cfg.chunk_size, cfg.K], [cfg.H, cfg.K, cfg.V]],
        "small_seconds_per_call": small,
        "small_gflops": small_flops / small / 1e9,
    }
