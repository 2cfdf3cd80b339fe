"""Benchmark the chunked gated delta rule against the reference implementations, in one process.

For each implementation: forward time (no autograd graph) and forward+backward time (gradients of
q, k, v, g, beta for a fixed random cotangent on o): warm-up rounds, then the median of
``--repeats`` rounds in which all implementations take turns (load from other processes then
spreads over all of them).
One extra untimed forward+backward checks that every implementation agrees with transformers
(max |a - b| / max |b| per tensor, target 1e-5). It also measures this machine's fp32 matmul
rates (one large square matmul, and the small batched matmul at the kernel's shapes) and rates
our kernel against them using the FLOP count of its algorithm (:func:`chunk_gdn_flops`): "of mm" is
the fraction of the large-matmul rate, "of small" of the small batched matmul rate.

Implementations (backend ``torch``):
- ``ours``: :func:`hyperpar_gdn.ops.chunk_gated_delta_rule`, in-kernel l2norm.
- ``transformers``: the raw ``torch_chunk_gated_delta_rule`` of ``transformers`` (Qwen3.5), in-kernel l2norm.
- ``fla_naive``: ``naive_chunk_gated_delta_rule`` from fla's ``ops/gated_delta_rule/naive.py``,
  loaded by file path (``fla.ops`` imports triton). It does not l2-normalise, so its function
  l2-normalises q and k first (same formula and eps) INSIDE the timed region, and its gradients
  are taken with respect to the raw q and k like the others'.

A backend is a class with the methods of :class:`TorchBackend`; ``BACKENDS`` maps ``--backend``
names to them. ``--backend mindspore`` (:class:`MindSporeBackend`) times ``ours`` on MindSpore
tensors beside ``ours_torch`` and ``transformers`` on torch tensors of the same values; the matmul
rates are then MindSpore's, and the report gives MindSpore's time over torch's for the same code
(``mindspore_over_torch``, target <= 2.5): the ratio of the medians, the median of the
per-round ratios (the two take turns each round, so a round's ratio sees the same load) and the
ratio of the fastest runs. Its
default T is 2048 (the issue's shape, B1 H4 K=V=128 fp32); torch's is 4096.

Packed documents (torch): ``--packed-T`` tokens (8192) cut into ``--packed-docs`` documents (8) of
random lengths, ``ours`` with ``cu_seqlens`` (masks inside the chunks) against ``ours`` unpacked on
the same tokens, forward+backward, timed in alternation; the ratio packed / unpacked (target
<= 1.15) and the packed output's error against each document run alone are printed and saved
under ``packed``. ``--packed-docs 0`` skips it.

Every implementation runs with freed host memory kept in the heap
(:func:`hyperpar_gdn.platform.host_memory.keep_freed_host_memory`; ``--glibc-malloc-defaults``
leaves glibc's settings alone); ``machine.freed_host_memory_kept`` records which.

Usage: ``python scripts/bench_ops.py [--T 4096 --H 4 --K 128 --repeats 5 --threads 2]``;
``OMP_WAIT_POLICY=PASSIVE python scripts/bench_ops.py --backend mindspore --threads 2`` (or
``--threads 1``). Writes ``results/bench_ops.json`` unless ``--out`` says otherwise. The load
average of the machine before and after the run is in the report (``machine.load_average``).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from hyperpar_gdn.cli import HelpFormatter
from hyperpar_gdn.platform.host_memory import keep_freed_host_memory

TARGET_REL_ERR = 1e-5
TARGET_PACKED_RATIO = 1.15
TARGET_MINDSPORE_OVER_TORCH = 2.5
DEFAULT_T = {"torch": 4096, "mindspore": 2048}
L2NORM_EPS = 1e-6
GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta")


@dataclass(frozen=True)
class BenchConfig:
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


# --- FLOP count ------------------------------------------------------------------------------------


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


# --- the torch backend -----------------------------------------------------------------------------


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
        """GFLOP/s of one [size, size] x [size, size] fp32 matmul, and of the batched
        [H, C, K] x [H, K, V] matmuls the state recurrence issues (timed 100 at a time)."""
        torch, cfg = self.torch, self.cfg
        a, b = torch.randn(size, size), torch.randn(size, size)
        large = median_time(lambda: torch.matmul(a, b), repeats, warmup=1)
        sa, sb = torch.randn(cfg.H, cfg.chunk_size, cfg.K), torch.randn(cfg.H, cfg.K, cfg.V)
        calls = 100

        def small_batch() -> None:
            for _ in range(calls):
                torch.matmul(sa, sb)

        small = median_time(small_batch, repeats, warmup=1) / calls
        small_flops = 2 * cfg.H * cfg.chunk_size * cfg.K * cfg.V
        return {
            "large_shape": [size, size, size],
            "large_seconds": large,
            "large_gflops": 2 * size**3 / large / 1e9,
            "small_shape": [[cfg.H, cfg.chunk_size, cfg.K], [cfg.H, cfg.K, cfg.V]],
            "small_seconds_per_call": small,
            "small_gflops": small_flops / small / 1e9,
        }


# --- the MindSpore backend (beside torch) ------------------------------------------------------------


class MindSporeBackend(TorchBackend):
    """``ours`` on MindSpore tensors (PyNative, CPU, kernels launched synchronously as the
    MindSpore platform runs them), beside the torch implementations on the same input values:
    ``ours_torch`` (the same code on torch tensors) and ``transformers`` (the reference for the
    speed-ups and the agreement). Matmul rates are MindSpore's; the FLOP counter runs the torch
    twin of ``ours`` (the same algorithm, so the same count).

    Two thread pools share the cores here: torch's OpenMP threads spin after each parallel region
    and starve MindSpore's (measured: torch 20-50x slower beside MindSpore with 2 threads each).
    Run with ``OMP_WAIT_POLICY=PASSIVE`` or ``--threads 1``; anything else is flagged in the report.
    """

    name = "mindspore"

    def __init__(self, cfg: BenchConfig) -> None:
        super().__init__(cfg)
        import mindspore

        from hyperpar_gdn.platform.mindspore_ops import enable_launch_blocking

        self.ms = mindspore
        mindspore.set_context(mode=mindspore.PYNATIVE_MODE)
        if cfg.threads is not None:
            mindspore.set_context(runtime_num_threads=cfg.threads)
        enable_launch_blocking()
        self._grad_fns: dict[int, Callable] = {}
        self._torch_ours: Callable | None = None

    def info(self) -> dict[str, Any]:
        policy = os.environ.get("OMP_WAIT_POLICY", "")
        fair = policy.upper() == "PASSIVE" or self.cfg.threads == 1
        return {
            **super().info(),
            "mindspore": self.ms.__version__,
            "omp_wait_policy": policy or None,
            "thread_pools_fair": fair,
        }

    def make_inputs(self) -> dict[str, Any]:
        """The torch inputs, plus MindSpore copies of them under ``ms_<name>``."""
        inputs = super().make_inputs()
        for name in ("q", "k", "v", "g", "beta", "do"):
            inputs[f"ms_{name}"] = self.ms.Tensor(inputs[name].detach().numpy())
        return inputs

    def implementations(self) -> dict[str, Callable[[dict[str, Any]], Any]]:
        from hyperpar_gdn.ops import chunk_gated_delta_rule

        torch_impls = super().implementations()
        self._torch_ours = torch_impls["ours"]
        c = self.cfg.chunk_size

        def ours(x: dict[str, Any]) -> Any:
            o, _ = chunk_gated_delta_rule(
                x["ms_q"],
                x["ms_k"],
                x["ms_v"],
                x["ms_g"],
                x["ms_beta"],
                chunk_size=c,
                use_qk_l2norm_in_kernel=True,
            )
            return o

        ours.framework = "mindspore"  # type: ignore[attr-defined]
        return {"ours": ours, "ours_torch": torch_impls["ours"], "transformers": torch_impls["transformers"]}

    @staticmethod
    def _is_mindspore(fn: Callable) -> bool:
        return getattr(fn, "framework", None) == "mindspore"

    def forward(self, fn: Callable, x: dict[str, Any]) -> Any:
        return fn(x) if self._is_mindspore(fn) else super().forward(fn, x)

    def forward_backward(self, fn: Callable, x: dict[str, Any]) -> tuple[Any, list[Any]]:
        if not self._is_mindspore(fn):
            return super().forward_backward(fn, x)
        names = [name[1:] for name in GRAD_NAMES]
        grad_fn = self._grad_fns.get(id(fn))
        if grad_fn is None:

            def of_tensors(*tensors: Any) -> Any:
                return fn({f"ms_{name}": t for name, t in zip(names, tensors, strict=True)})

            grad_fn = self.ms.value_and_grad(
                of_tensors, grad_position=tuple(range(len(names))), sens_param=True
            )
            self._grad_fns[id(fn)] = grad_fn
        o, grads = grad_fn(*(x[f"ms_{name}"] for name in names), x["ms_do"])
        return o, list(grads)

    def to_numpy(self, x: Any) -> np.ndarray:
        if isinstance(x, self.ms.Tensor):
            return x.asnumpy().astype(np.float64)
        return super().to_numpy(x)

    def measured_flops(self, fn: Callable, x: dict[str, Any]) -> int:
        assert self._torch_ours is not None, "implementations() first"
        return super().measured_flops(self._torch_ours, x)

    def matmul_rates(self, size: int, repeats: int) -> dict[str, Any]:
        """As TorchBackend.matmul_rates, with MindSpore's matmul (``mint.matmul``)."""
        ms, cfg = self.ms, self.cfg
        mint = ms.mint
        rng = np.random.default_rng(cfg.seed)

        def randn(*shape: int) -> Any:  # mint.randn has no CPU kernel in MindSpore 2.10
            return ms.Tensor(rng.standard_normal(shape).astype(np.float32))

        a, b = randn(size, size), randn(size, size)
        large = median_time(lambda: mint.matmul(a, b), repeats, warmup=1)
        sa, sb = randn(cfg.H, cfg.chunk_size, cfg.K), randn(cfg.H, cfg.K, cfg.V)
        calls = 100

        def small_batch() -> None:
            for _ in range(calls):
                mint.matmul(sa, sb)

        small = median_time(small_batch, repeats, warmup=1) / calls
        small_flops = 2 * cfg.H * cfg.chunk_size * cfg.K * cfg.V
        return {
            "large_shape": [size, size, size],
            "large_seconds": large,
            "large_gflops": 2 * size**3 / large / 1e9,
            "small_shape": [[cfg.H, cfg.chunk_size, cfg.K], [cfg.H, cfg.K, cfg.V]],
            "small_seconds_per_call": small,
            "small_gflops": small_flops / small / 1e9,
        }


BACKENDS: dict[str, type[TorchBackend]] = {"torch": TorchBackend, "mindspore": MindSporeBackend}


# --- measurement -----------------------------------------------------------------------------------


def median_time(fn: Callable[[], Any], repeats: int, warmup: int) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs after ``warmup`` untimed runs (CPU
    execution is synchronous)."""
    return statistics.median(round_robin_times({"fn": fn}, repeats, warmup)["fn"])


def round_robin_times(
    calls: dict[str, Callable[[], Any]], repeats: int, warmup: int
) -> dict[str, list[float]]:
    """Wall times of every call, ``repeats`` rounds of one run each after ``warmup`` untimed rounds.
    Taking turns spreads load from other processes over all calls rather than onto one."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for round_index in range(warmup + repeats):
        for name, fn in calls.items():
            start = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - start
            if round_index >= warmup:
                times[name].append(elapsed)
    return times


def rel_err(actual: np.ndarray, expected: np.ndarray) -> float:
    """max |actual - expected| / max |expected|."""
    return float(np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-30))


def agreement(backend: TorchBackend, impls: dict[str, Callable], x: dict[str, Any]) -> dict[str, Any]:
    """Per implementation, the relative error of o and of every input gradient vs transformers."""
    results = {}
    for name, fn in impls.items():
        o, grads = backend.forward_backward(fn, x)
        results[name] = dict(zip(("o", *GRAD_NAMES), (backend.to_numpy(t) for t in (o, *grads)), strict=True))
    reference = results["transformers"]
    report = {}
    for name, tensors in results.items():
        errors = {t: rel_err(tensors[t], reference[t]) for t in tensors}
        report[name] = {"rel_err": errors, "within_target": max(errors.values()) <= TARGET_REL_ERR}
    return report


def mindspore_over_torch(samples: dict[str, list[float]]) -> dict[str, Any]:
    """MindSpore's ``ours`` over torch's ``ours_torch`` (same code and inputs), forward and
    forward+backward: the ratio of the medians (the target's measure), the median of the
    per-round ratios, and the ratio of the fastest runs (least disturbed by other jobs)."""
    report: dict[str, Any] = {"target": TARGET_MINDSPORE_OVER_TORCH}
    for mode in ("forward", "forward_backward"):
        ms_times, torch_times = samples[f"ours/{mode}"], samples[f"ours_torch/{mode}"]
        per_round = [m / t for m, t in zip(ms_times, torch_times, strict=True)]
        report[mode] = {
            "ratio_of_medians": statistics.median(ms_times) / statistics.median(torch_times),
            "median_of_round_ratios": statistics.median(per_round),
            "ratio_of_minima": min(ms_times) / min(torch_times),
            "round_ratios": per_round,
        }
    report["within_target"] = report["forward_backward"]["ratio_of_medians"] <= TARGET_MINDSPORE_OVER_TORCH
    return report


def run(cfg: BenchConfig, matmul_size: int) -> dict[str, Any]:
    load_before = os.getloadavg()
    kept = keep_freed_host_memory() if cfg.keep_host_memory else False
    backend = BACKENDS[cfg.backend](cfg)
    impls = backend.implementations()
    x = backend.make_inputs()
    print(f"config: {asdict(cfg)}; {backend.info()}", flush=True)

    agree = agreement(backend, impls, x)
    calls: dict[str, Callable[[], Any]] = {}
    for name, fn in impls.items():
        calls[f"{name}/forward"] = lambda fn=fn: backend.forward(fn, x)
        calls[f"{name}/forward_backward"] = lambda fn=fn: backend.forward_backward(fn, x)
    samples = round_robin_times(calls, cfg.repeats, cfg.warmup)
    timings = {}
    for name in impls:
        fwd, fwd_bwd = samples[f"{name}/forward"], samples[f"{name}/forward_backward"]
        timings[name] = {
            "forward_s": statistics.median(fwd),
            "forward_backward_s": statistics.median(fwd_bwd),
            "forward_min_s": min(fwd),
            "forward_backward_min_s": min(fwd_bwd),
            "forward_samples_s": fwd,
            "forward_backward_samples_s": fwd_bwd,
        }

    rates = backend.matmul_rates(matmul_size, max(cfg.repeats, 3))
    flops = chunk_gdn_flops(cfg)
    counted = backend.measured_flops(impls["ours"], x)
    flops["flop_counter_ours_forward_backward"] = counted
    # FlopCounterMode sees every matmul but not the triangular solve.
    solve_flops = flops["per_block_forward"]["prep: Tinv = solve(I + A, I)"] * flops["blocks"]
    flops["analytic_matches_flop_counter"] = counted == flops["forward_backward"] - solve_flops
    ref = timings["transformers"]
    for t in timings.values():
        t["speedup_forward_vs_transformers"] = ref["forward_s"] / t["forward_s"]
        t["speedup_forward_backward_vs_transformers"] = ref["forward_backward_s"] / t["forward_backward_s"]
        # Rate of our algorithm's work over this implementation's time (same count for all).
        t["effective_gflops"] = flops["forward_backward"] / t["forward_backward_s"] / 1e9
        t["fraction_of_large_matmul"] = t["effective_gflops"] / rates["large_gflops"]
        t["fraction_of_small_batched_matmul"] = t["effective_gflops"] / rates["small_gflops"]
    return {
        "config": asdict(cfg),
        "machine": {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "freed_host_memory_kept": kept,
            "load_average": {"before": list(load_before), "after_timing": list(os.getloadavg())},
            **backend.info(),
        },
        "notes": {
            "forward": "no autograd graph (inference)",
            "timing": "implementations take turns each round; medians of the rounds after warm-up",
            "forward_backward": "gradients of q, k, v, g, beta for a fixed cotangent on o",
            "fla_naive": "q, k l2-normalised inside its function (timed), gradients w.r.t. raw q, k",
            "effective_gflops": "chunk_gdn_flops forward+backward / forward+backward time",
            "flops": "matmul-class FLOPs; the unit-lower solve counts C^3 per block",
        },
        "timings": timings,
        "agreement_vs_transformers": agree,
        "target_rel_err": TARGET_REL_ERR,
        "matmul": rates,
        "flops": flops,
        "mindspore_over_torch": mindspore_over_torch(samples) if "ours_torch" in impls else None,
        "packed": packed_case(cfg) if cfg.packed_docs > 0 else None,
    }


def packed_case(cfg: BenchConfig) -> dict[str, Any]:
    """Forward+backward of ``ours`` on ``cfg.packed_T`` tokens as ``cfg.packed_docs`` documents of
    random lengths (``cu_seqlens``) and on the same tokens unpacked, taking turns each round."""
    import torch

    from hyperpar_gdn.ops import chunk_gated_delta_rule

    packed_cfg = BenchConfig(**{**asdict(cfg), "T": cfg.packed_T, "B": 1, "backend": "torch"})
    backend = TorchBackend(packed_cfg)
    x = backend.make_inputs()
    rng = np.random.default_rng(cfg.seed)
    cuts = np.sort(rng.choice(np.arange(1, cfg.packed_T), cfg.packed_docs - 1, replace=False))
    cu = [0, *cuts.tolist(), cfg.packed_T]
    cu_tensor = torch.tensor(cu, dtype=torch.int32)
    c = cfg.chunk_size

    def unpacked(y: dict[str, Any]) -> Any:
        o, _ = chunk_gated_delta_rule(
            y["q"], y["k"], y["v"], y["g"], y["beta"], chunk_size=c, use_qk_l2norm_in_kernel=True
        )
        return o

    def packed(y: dict[str, Any]) -> Any:
        o, _ = chunk_gated_delta_rule(
            y["q"], y["k"], y["v"], y["g"], y["beta"], chunk_size=c, use_qk_l2norm_in_kernel=True,
            cu_seqlens=cu_tensor,
        )  # fmt: skip
        return o

    with torch.no_grad():  # each document alone, for the error of the packed output
        alone = torch.cat(
            [
                chunk_gated_delta_rule(
                    *(x[n][:, a:b] for n in ("q", "k", "v", "g", "beta")), chunk_size=c,
                    use_qk_l2norm_in_kernel=True,
                )[0]
                for a, b in zip(cu[:-1], cu[1:], strict=True)
            ],
            1,
        )  # fmt: skip
        err = rel_err(backend.to_numpy(packed(x)), backend.to_numpy(alone))
    samples = round_robin_times(
        {
            "unpacked": lambda: backend.forward_backward(unpacked, x),
            "packed": lambda: backend.forward_backward(packed, x),
        },
        cfg.repeats,
        cfg.warmup,
    )
    med = {name: statistics.median(times) for name, times in samples.items()}
    ratio = med["packed"] / med["unpacked"]
    return {
        "T": cfg.packed_T,
        "cu_seqlens": cu,
        "forward_backward_s": med,
        "forward_backward_samples_s": samples,
        "ratio_packed_over_unpacked": ratio,
        "target_ratio": TARGET_PACKED_RATIO,
        "within_target": ratio <= TARGET_PACKED_RATIO,
        "rel_err_vs_documents_alone": err,
    }


def print_report(result: dict[str, Any]) -> None:
    timings, agree = result["timings"], result["agreement_vs_transformers"]
    header = (
        f"{'implementation':<14}{'fwd ms':>10}{'fwd+bwd ms':>12}{'x fwd':>8}{'x fwd+bwd':>11}"
        f"{'GFLOP/s':>9}{'of mm':>7}{'of small':>9}{'err o':>10}{'err grads':>11}"
    )
    print(header)
    print("-" * len(header))
    for name, t in timings.items():
        errors = agree[name]["rel_err"]
        grad_err = max(errors[g] for g in GRAD_NAMES)
        print(
            f"{name:<14}{t['forward_s'] * 1e3:>10.1f}{t['forward_backward_s'] * 1e3:>12.1f}"
            f"{t['speedup_forward_vs_transformers']:>8.2f}{t['speedup_forward_backward_vs_transformers']:>11.2f}"
            f"{t['effective_gflops']:>9.1f}{t['fraction_of_large_matmul']:>7.0%}"
            f"{t['fraction_of_small_batched_matmul']:>9.0%}"
            f"{errors['o']:>10.1e}{grad_err:>11.1e}"
        )
    mm, flops = result["matmul"], result["flops"]
    if result["machine"].get("thread_pools_fair") is False:
        print(
            "WARNING: torch and MindSpore thread pools contend; rerun with OMP_WAIT_POLICY=PASSIVE or --threads 1"
        )
    print(
        f"matmul fp32: {mm['large_gflops']:.1f} GFLOP/s large {mm['large_shape'][0]}^3, "
        f"{mm['small_gflops']:.1f} GFLOP/s small batched {mm['small_shape']}"
    )
    print(
        f"FLOPs (ours' algorithm): forward {flops['forward'] / 1e9:.2f} G, backward "
        f"{flops['backward'] / 1e9:.2f} G, total {flops['forward_backward'] / 1e9:.2f} G "
        f"(FlopCounterMode, no solve: {flops['flop_counter_ours_forward_backward'] / 1e9:.2f} G, "
        f"{'matches' if flops['analytic_matches_flop_counter'] else 'DIFFERS FROM'} the analytic count)"
    )
    for name, a in agree.items():
        status = "ok" if a["within_target"] else "ABOVE TARGET"
        worst = max(a["rel_err"], key=a["rel_err"].get)
        print(
            f"agreement {name}: worst {worst} {a['rel_err'][worst]:.1e} vs {result['target_rel_err']:.0e}: {status}"
        )
    ratio = result.get("mindspore_over_torch")
    if ratio:
        cfg = result["config"]
        fwd, fwd_bwd = ratio["forward"], ratio["forward_backward"]
        print(
            f"MindSpore / torch, same code (B{cfg['B']} T{cfg['T']} H{cfg['H']} K{cfg['K']} V{cfg['V']} fp32): "
            f"forward {fwd['ratio_of_medians']:.2f}x, forward+backward {fwd_bwd['ratio_of_medians']:.2f}x "
            f"(median of round ratios {fwd['median_of_round_ratios']:.2f}x, "
            f"{fwd_bwd['median_of_round_ratios']:.2f}x; fastest runs {fwd['ratio_of_minima']:.2f}x, "
            f"{fwd_bwd['ratio_of_minima']:.2f}x); target forward+backward <= {ratio['target']}: "
            f"{'ok' if ratio['within_target'] else 'ABOVE TARGET'}"
        )
    load = result["machine"]["load_average"]
    print(
        f"load average (1, 5, 15 min): before {', '.join(f'{x:.2f}' for x in load['before'])}; "
        f"after timing {', '.join(f'{x:.2f}' for x in load['after_timing'])} "
        f"on {result['machine']['cpu_count']} cores"
    )
    packed = result.get("packed")
    if packed:
        t = packed["forward_backward_s"]
        print(
            f"packed T={packed['T']} as {len(packed['cu_seqlens']) - 1} documents {packed['cu_seqlens']}: "
            f"fwd+bwd {t['packed'] * 1e3:.1f} ms vs unpacked {t['unpacked'] * 1e3:.1f} ms = "
            f"{packed['ratio_packed_over_unpacked']:.3f}x (target <= {packed['target_ratio']}: "
            f"{'ok' if packed['within_target'] else 'ABOVE TARGET'}); o vs documents alone "
            f"{packed['rel_err_vs_documents_alone']:.1e}"
        )


def parse_args(argv: list[str] | None = None) -> tuple[BenchConfig, Path, int]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--B", type=int, default=1, help="batch size")
    parser.add_argument("--T", type=int, default=None, help=f"tokens (default: {DEFAULT_T} by backend)")
    parser.add_argument("--H", type=int, default=4, help="heads")
    parser.add_argument("--K", type=int, default=128, help="key dim; the value dim too unless --V")
    parser.add_argument("--V", type=int, default=None, help="value dim (default: --K)")
    parser.add_argument("--chunk-size", type=int, default=64, help="chunk length C of the kernel")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument(
        "--matmul-size", type=int, default=2048, help="n of the n x n x n matmul that measures the machine"
    )
    parser.add_argument("--backend", choices=sorted(BACKENDS), default="torch", help="framework to time")
    parser.add_argument("--packed-T", type=int, default=8192, help="tokens of the packed case (torch)")
    parser.add_argument("--packed-docs", type=int, default=8, help="documents of the packed case; 0 skips it")
    parser.add_argument(
        "--glibc-malloc-defaults",
        action="store_true",
        help="leave glibc's malloc settings alone (default: keep_freed_host_memory(), for every implementation)",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("results/bench_ops.json"), help="JSON file of the results"
    )
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        parser.error(f"--repeats must be >= 1 and --warmup >= 0; got {args.repeats}, {args.warmup}")
    if args.packed_docs < 0 or (args.packed_docs and not 1 <= args.packed_docs <= args.packed_T):
        parser.error(f"--packed-docs must be 0 or in 1..--packed-T={args.packed_T}; got {args.packed_docs}")
    cfg = BenchConfig(
        B=args.B,
        T=DEFAULT_T[args.backend] if args.T is None else args.T,
        H=args.H,
        K=args.K,
        V=args.K if args.V is None else args.V,
        chunk_size=args.chunk_size,
        repeats=args.repeats,
        warmup=args.warmup,
        threads=args.threads,
        backend=args.backend,
        packed_T=args.packed_T,
        packed_docs=args.packed_docs,
        keep_host_memory=not args.glibc_malloc_defaults,
    )
    return cfg, args.out, args.matmul_size


def main(argv: list[str] | None = None) -> int:
    cfg, out, matmul_size = parse_args(argv)
    result = run(cfg, matmul_size)
    print_report(result)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if result["agreement_vs_transformers"]["ours"]["within_target"] else 1


if __name__ == "__main__":
    sys.exit(main())
