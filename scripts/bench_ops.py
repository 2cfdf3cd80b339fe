"""Benchmark the chunked gated delta rule against the reference implementations, in one process.

Per implementation (``ours``, transformers' and fla's references; :mod:`benchkit.gdn_ops`):
forward (no autograd graph) and forward+backward (gradients of q, k, v, g, beta for a fixed
cotangent on o) in alternating rounds, median of ``--repeats`` after ``--warmup``. An untimed
forward+backward checks every implementation against transformers (max |a - b| / max |b| per
tensor, target 1e-5). This machine's fp32 matmul rates (one large square matmul; the small
batched one at the kernel's shapes) rate our kernel by its algorithm's FLOP count
(:func:`benchkit.gdn_ops.chunk_gdn_flops`): "of mm" / "of small" are fractions of those rates.

``--backend mindspore`` (:class:`benchkit.gdn_ops_mindspore.MindSporeBackend`) times ``ours`` on
MindSpore tensors beside ``ours_torch`` and ``transformers`` on torch tensors of the same values;
the matmul rates are then MindSpore's, and the report gives MindSpore's time over torch's for the
same code (``mindspore_over_torch``, target <= 2.5): the ratio of the medians, the median of the
per-round ratios and the ratio of the fastest runs. Default T: 2048 (B1 H4 K=V=128 fp32); torch's 4096.

Packed documents (torch): ``--packed-T`` tokens (8192) cut into ``--packed-docs`` documents (8)
of random lengths, ``ours`` with ``cu_seqlens`` against ``ours`` unpacked on the same tokens,
forward+backward in alternation; the ratio packed / unpacked (target <= 1.15) and the packed
output's error against each document run alone go under ``packed``. ``--packed-docs 0`` skips it.

Freed host memory stays in the heap unless ``--glibc-malloc-defaults``
(``machine.freed_host_memory_kept``); ``machine.load_average`` is the load before and after.

Usage: ``python scripts/bench_ops.py [--T 4096 --H 4 --K 128 --repeats 5 --threads 2]``;
``OMP_WAIT_POLICY=PASSIVE python scripts/bench_ops.py --backend mindspore --threads 2`` (or
``--threads 1``). Writes ``results/bench_ops.json`` unless ``--out`` says otherwise.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchkit.gdn_ops import GRAD_NAMES, BenchConfig, TorchBackend, chunk_gdn_flops
from benchkit.gdn_ops_mindspore import MindSporeBackend
from benchkit.gdn_packed import describe_packed, packed_case
from benchkit.machine import keep_host_memory, load_average, machine_info
from benchkit.output import write_json
from benchkit.timing import alternating_rounds, compare, rel_err
from hyperpar_gdn.cli import HelpFormatter

TARGET_REL_ERR = 1e-5
TARGET_MINDSPORE_OVER_TORCH = 2.5
DEFAULT_T = {"torch": 4096, "mindspore": 2048}
BACKENDS: dict[str, type[TorchBackend]] = {"torch": TorchBackend, "mindspore": MindSporeBackend}


def agreement(backend: TorchBackend, impls: dict[str, Callable], x: dict[str, Any]) -> dict[str, Any]:
    """Per implementation, the relative error of o and of every input gradient vs transformers."""
    results = {}
    for name, fn in impls.items():
        o, grads = backend.forward_backward(fn, x)
        results[name] = dict(zip(("o", *GRAD_NAMES), (backend.to_numpy(t) for t in (o, *grads)), strict=True))
    report = {}
    for name, tensors in results.items():
        errors = {t: rel_err(tensors[t], results["transformers"][t]) for t in tensors}
        report[name] = {"rel_err": errors, "within_target": max(errors.values()) <= TARGET_REL_ERR}
    return report


def mindspore_over_torch(samples: dict[str, list[float]]) -> dict[str, Any]:
    """MindSpore's ``ours`` over torch's ``ours_torch`` (same code and inputs), forward and
    forward+backward (:func:`benchkit.timing.compare`); the target is on the ratio of the medians
    of forward+backward."""
    report: dict[str, Any] = {"target": TARGET_MINDSPORE_OVER_TORCH}
    for mode in ("forward", "forward_backward"):
        report[mode] = compare(samples[f"ours/{mode}"], samples[f"ours_torch/{mode}"])
    report["within_target"] = report["forward_backward"]["ratio_of_medians"] <= TARGET_MINDSPORE_OVER_TORCH
    return report


def timings_of(samples: dict[str, list[float]], names: list[str]) -> dict[str, Any]:
    """Per implementation: medians, minima and samples of forward and forward+backward."""
    timings = {}
    for name in names:
        fwd, fwd_bwd = samples[f"{name}/forward"], samples[f"{name}/forward_backward"]
        timings[name] = {
            "forward_s": statistics.median(fwd),
            "forward_backward_s": statistics.median(fwd_bwd),
            "forward_min_s": min(fwd),
            "forward_backward_min_s": min(fwd_bwd),
            "forward_samples_s": fwd,
            "forward_backward_samples_s": fwd_bwd,
        }
    return timings


def run(cfg: BenchConfig, matmul_size: int) -> dict[str, Any]:
    load_before = load_average()
    kept = keep_host_memory(cfg.keep_host_memory)
    backend = BACKENDS[cfg.backend](cfg)
    impls = backend.implementations()
    x = backend.make_inputs()
    print(f"config: {asdict(cfg)}; {backend.info()}", flush=True)
    agree = agreement(backend, impls, x)
    calls: dict[str, Callable[[], Any]] = {}
    for name, fn in impls.items():
        calls[f"{name}/forward"] = lambda fn=fn: backend.forward(fn, x)
        calls[f"{name}/forward_backward"] = lambda fn=fn: backend.forward_backward(fn, x)
    samples = alternating_rounds(calls, repeats=cfg.repeats, warmup=cfg.warmup)
    timings = timings_of(samples, list(impls))
    load_after = load_average()
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
    machine = {**machine_info(), "freed_host_memory_kept": kept, **backend.info()}
    machine["load_average"] = {"before": load_before, "after_timing": load_after}
    return {
        "config": asdict(cfg),
        "machine": machine,
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


def print_report(result: dict[str, Any]) -> None:
    timings, agree = result["timings"], result["agreement_vs_transformers"]
    header = (
        f"{'implementation':<14}{'fwd ms':>10}{'fwd+bwd ms':>12}{'x fwd':>8}{'x fwd+bwd':>11}"
        f"{'GFLOP/s':>9}{'of mm':>7}{'of small':>9}{'err o':>10}{'err grads':>11}"
    )
    print(f"{header}\n{'-' * len(header)}")
    for name, t in timings.items():
        errors = agree[name]["rel_err"]
        print(
            f"{name:<14}{t['forward_s'] * 1e3:>10.1f}{t['forward_backward_s'] * 1e3:>12.1f}"
            f"{t['speedup_forward_vs_transformers']:>8.2f}{t['speedup_forward_backward_vs_transformers']:>11.2f}"
            f"{t['effective_gflops']:>9.1f}{t['fraction_of_large_matmul']:>7.0%}"
            f"{t['fraction_of_small_batched_matmul']:>9.0%}"
            f"{errors['o']:>10.1e}{max(errors[g] for g in GRAD_NAMES):>11.1e}"
        )
    mm, flops = result["matmul"], result["flops"]
    if result["machine"].get("thread_pools_fair") is False:
        print(
            "WARNING: torch and MindSpore thread pools contend; rerun with OMP_WAIT_POLICY=PASSIVE or --threads 1"
        )
    print(
        f"matmul fp32: {mm['large_gflops']:.1f} GFLOP/s large {mm['large_shape'][0]}^3, "
        f"{mm['small_gflops']:.1f} GFLOP/s small batched {mm['small_shape']}\n"
        f"FLOPs (ours' algorithm): forward {flops['forward'] / 1e9:.2f} G, backward "
        f"{flops['backward'] / 1e9:.2f} G, total {flops['forward_backward'] / 1e9:.2f} G "
        f"(FlopCounterMode, no solve: {flops['flop_counter_ours_forward_backward'] / 1e9:.2f} G, "
        f"{'matches' if flops['analytic_matches_flop_counter'] else 'DIFFERS FROM'} the analytic count)"
    )
    for name, a in agree.items():
        worst = max(a["rel_err"], key=a["rel_err"].get)
        status = "ok" if a["within_target"] else "ABOVE TARGET"
        print(
            f"agreement {name}: worst {worst} {a['rel_err'][worst]:.1e} vs {result['target_rel_err']:.0e}: {status}"
        )
    ratio, cfg = result.get("mindspore_over_torch"), result["config"]
    if ratio:
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
    if result.get("packed"):
        print(describe_packed(result["packed"]))


def parse_args(argv: list[str] | None = None) -> tuple[BenchConfig, Path, int]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    add = parser.add_argument
    add("--B", type=int, default=1, help="batch size")
    add("--T", type=int, default=None, help=f"tokens (default: {DEFAULT_T} by backend)")
    add("--H", type=int, default=4, help="heads")
    add("--K", type=int, default=128, help="key dim; the value dim too unless --V")
    add("--V", type=int, default=None, help="value dim (default: --K)")
    add("--chunk-size", type=int, default=64, help="chunk length C of the kernel")
    add("--repeats", type=int, default=5, help="timed rounds (median reported)")
    add("--warmup", type=int, default=1, help="untimed rounds first")
    add("--threads", type=int, default=None, help="torch's and MindSpore's CPU threads (default: theirs)")
    add("--matmul-size", type=int, default=2048, help="n of the n x n x n matmul that measures the machine")
    add("--backend", choices=sorted(BACKENDS), default="torch", help="framework to time")
    add("--packed-T", type=int, default=8192, help="tokens of the packed case (torch)")
    add("--packed-docs", type=int, default=8, help="documents of the packed case; 0 skips it")
    add(
        "--glibc-malloc-defaults",
        action="store_true",
        help="leave glibc's malloc settings alone (default: keep_freed_host_memory(), for every implementation)",
    )
    add("--out", type=Path, default=Path("results/bench_ops.json"), help="JSON file of the results")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        parser.error(f"--repeats must be >= 1 and --warmup >= 0; got {args.repeats}, {args.warmup}")
    if args.packed_docs < 0 or (args.packed_docs and not 1 <= args.packed_docs <= args.packed_T):
        parser.error(f"--packed-docs must be 0 or in 1..--packed-T={args.packed_T}; got {args.packed_docs}")
    same = ("B", "H", "K", "chunk_size", "repeats", "warmup", "threads", "backend", "packed_T", "packed_docs")
    cfg = BenchConfig(
        **{name: getattr(args, name) for name in same},
        T=DEFAULT_T[args.backend] if args.T is None else args.T,
        V=args.K if args.V is None else args.V,
        keep_host_memory=not args.glibc_malloc_defaults,
    )
    return cfg, args.out, args.matmul_size


def main(argv: list[str] | None = None) -> int:
    cfg, out, matmul_size = parse_args(argv)
    result = run(cfg, matmul_size)
    print_report(result)
    write_json(out, result)
    print(f"wrote {out}")
    return 0 if result["agreement_vs_transformers"]["ours"]["within_target"] else 1


if __name__ == "__main__":
    sys.exit(main())
