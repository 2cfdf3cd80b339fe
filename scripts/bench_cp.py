"""Benchmark the context-parallel modes against one device: time, memory and traffic per rank.

For each mode and cp in ``--cp-sizes``, ranks are forked processes in a real gloo group
(:func:`benchkit.ranks.on_ranks`; the same code runs on cuda/npu through HP_PLATFORM). Two sweeps:

- fixed total T (``--seq-len``): each rank holds T/cp tokens; speed-up over cp=1 is the point.
- fixed local T (``--local-seq-len``): each rank holds the same tokens whatever cp; the cost of CP.

And parallel efficiency with one core per rank (``--efficiency-cp``, 2 by default, 0 skips it):
the whole sequence (``--seq-len``) in one process with 1 thread against ``cp`` ranks of 1 thread
holding T/cp tokens each, in alternating rounds of the same processes (:mod:`benchkit.cp_layer`):
the speed-up (median single time / median over rounds of the slowest rank's CP time), the
efficiency (speed-up / cp) and the machine bound (the plain layer on every shard side by side).

Threads: ``--total-threads`` is split evenly over the ranks (cp=1 gets all of them). Per rank and
configuration: the median forward+backward time over ``--repeats`` after a warm-up, activation
memory (storages saved for backward, parameters excluded), peak RSS growth, and the bytes sent
next to the formulas of docs/modes.md. Results: JSON (``--out``) and a PNG plot beside it.

``--backend mindspore`` (or ``torch mindspore``) times the MindSpore layer on msrun workers running
this script in worker mode (rows with ``backend="mindspore"``, no activation memory). Every process
keeps freed host memory unless ``--glibc-malloc-defaults`` (``freed_host_memory_kept``).

Usage: ``python scripts/bench_cp.py [--seq-len 8192 --local-seq-len 2048 --cp-sizes 1 2 4]
[--backend torch mindspore]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchkit.cp_layer import (
    LOCAL,
    LayerShape,
    config_row,
    measure_efficiency,
    measure_step,
    measure_step_mindspore,
)
from benchkit.machine import keep_host_memory, load_average
from benchkit.output import Panel, save_png, write_json
from benchkit.ranks import on_msrun, on_ranks
from benchkit.timing import machine_bound, slowest_per_round
from hyperpar_gdn.cli import HelpFormatter
from hyperpar_gdn.planning.plan import HEAD_MODES, MODES
from hyperpar_gdn.platform.msrun import start_watchdog, write_result

# cp=2, one core per rank: the head-parallel modes 0.9, the state modes 0.85
EFFICIENCY_TARGETS = {mode: 0.9 if mode in HEAD_MODES else 0.85 for mode in MODES}
BACKENDS = ("torch", "mindspore")


def run_efficiency(cp: int, job: dict[str, Any], *, timeout_s: float) -> dict[str, Any]:
    """Parallel efficiency at ``cp`` ranks of one thread each against one thread, per mode."""
    ranks = on_ranks(measure_efficiency, cp, job, threads=1, timeout_s=timeout_s)
    single, single_cpu = ranks[0]["single"], ranks[0]["single/cpu"]
    local = slowest_per_round([r[LOCAL] for r in ranks])
    rows = {}
    for mode in job["modes"]:
        per_round = slowest_per_round([r[mode] for r in ranks])
        speedup = statistics.median(single) / statistics.median(per_round)
        rows[mode] = {
            "cp": cp,
            "seq_len": job["seq_len"],
            "threads_per_rank": 1,
            "single_s": statistics.median(single),
            "cp_slowest_rank_s": statistics.median(per_round),
            "speedup": speedup,
            "parallel_efficiency": speedup / cp,
            # the fastest round of each: less sensitive to other processes' load on a shared machine
            "speedup_best_rounds": min(single) / min(per_round),
            "parallel_efficiency_best_rounds": min(single) / min(per_round) / cp,
            # process CPU time instead of wall time: blind to other processes' load, and to time a
            # rank spends blocked waiting for a peer (communication latency), so an upper bound
            "parallel_efficiency_cpu_time": statistics.median(single_cpu)
            / statistics.median(slowest_per_round([r[f"{mode}/cpu"] for r in ranks]))
            / cp,
            "target_efficiency": EFFICIENCY_TARGETS[mode],
            "local_side_by_side_s": statistics.median(local),
            "machine_bound_efficiency": machine_bound(single, local, cp),
            "cp_over_local": statistics.median([c / lo for c, lo in zip(per_round, local, strict=True)]),
            "single_samples_s": single,
            "cp_slowest_rank_samples_s": per_round,
            "cp_samples_s_per_rank": [r[mode] for r in ranks],
            "single_cpu_samples_s": single_cpu,
            "cp_cpu_samples_s_per_rank": [r[f"{mode}/cpu"] for r in ranks],
            "local_side_by_side_samples_s": local,
        }
    return rows


def print_efficiency(rows: dict[str, Any]) -> None:
    print(
        f"{'mode':<15}{'cp':>3}{'T':>7}{'1 thread s':>12}{'cp ranks s':>12}{'speed-up':>10}"
        f"{'efficiency':>12}{'target':>8}{'best rounds':>13}{'CPU time':>10}{'local s':>9}{'bound':>7}"
        f"{'cp/local':>10}"
    )
    for mode, r in rows.items():
        print(
            f"{mode:<15}{r['cp']:>3}{r['seq_len']:>7}{r['single_s']:>12.3f}{r['cp_slowest_rank_s']:>12.3f}"
            f"{r['speedup']:>10.2f}{r['parallel_efficiency']:>12.3f}{r['target_efficiency']:>8.2f}"
            f"{r['parallel_efficiency_best_rounds']:>13.3f}{r['parallel_efficiency_cpu_time']:>10.3f}"
            f"{r['local_side_by_side_s']:>9.3f}{r['machine_bound_efficiency']:>7.3f}{r['cp_over_local']:>10.3f}"
        )
    print(
        "efficiency = speed-up / cp; speed-up = median single time / median over rounds of the slowest "
        "rank's time (best rounds: fastest round of each; CPU time: process CPU time instead of wall "
        "time, an upper bound blind to load and to waits); local: the plain layer on each shard, all "
        "ranks at once, no communication (bound = single / (cp x local), what the machine allows; "
        f"cp/local: the CP step over it, per round); load average now {load_average()[0]:.2f}"
    )


def run_config(
    backend: str, cp: int, threads: int, job: dict[str, Any], timeout_s: float
) -> list[dict[str, Any]]:
    """One configuration's per-rank results (torch: forked ranks; MindSpore: msrun workers)."""
    if backend == "torch":
        return on_ranks(measure_step, cp, job, threads=threads, timeout_s=timeout_s)
    args = ["--worker-job", json.dumps({**job, "timeout_s": timeout_s}), "--total-threads", str(threads)]
    return on_msrun(Path(__file__).resolve(), cp, args, threads=threads, timeout_s=timeout_s)


def summarize(rows: list[dict[str, Any]]) -> None:
    base = {(r["backend"], r["sweep"], r["mode"]): r for r in rows if r["cp"] == 1}
    print(
        f"{'backend':<11}{'sweep':<12}{'mode':<15}{'cp':>3}{'T/cp':>7}{'time/rank s':>13}{'speed-up':>10}"
        f"{'act MiB':>10}{'act ratio':>11}{'sent KiB':>11}{'expected':>11}"
    )
    for r in rows:
        b = base.get((r["backend"], r["sweep"], r["mode"]))
        r["speedup_vs_cp1"] = b["time_s"] / r["time_s"] if b else None
        measured = b is not None and r["activation_bytes"] is not None and b["activation_bytes"]
        r["activation_ratio_vs_cp1"] = r["activation_bytes"] / b["activation_bytes"] if measured else None
        activation = "-" if r["activation_bytes"] is None else f"{r['activation_bytes'] / 2**20:.1f}"
        print(
            f"{r['backend']:<11}{r['sweep']:<12}{r['mode']:<15}{r['cp']:>3}{r['local_seq_len']:>7}"
            f"{r['time_s']:>13.3f}{(r['speedup_vs_cp1'] or 0):>10.2f}{activation:>10}"
            f"{(r['activation_ratio_vs_cp1'] or 0):>11.3f}{r['bytes_sent'] / 1024:>11.1f}"
            f"{r['expected_bytes'] / 1024:>11.1f}"
        )


def panels(rows: list[dict[str, Any]]) -> list[Panel]:
    """Time against cp per sweep (every backend and mode), activation memory at fixed total T."""
    backends = sorted({r["backend"] for r in rows})
    out = []
    for sweep in ("fixed_total", "fixed_local"):
        panel = Panel(f"time, {sweep.replace('_', ' ')} T", "cp", "forward+backward s (slowest rank)")
        for r in (r for r in rows if r["sweep"] == sweep):
            label = r["mode"] if len(backends) == 1 else f"{r['backend']} {r['mode']}"
            panel.lines.setdefault(label, []).append((r["cp"], r["time_s"]))
        out.append(panel)
    memory = Panel("activation memory, fixed total T", "cp", "MiB per rank")
    for r in rows:
        if r["sweep"] == "fixed_total" and r["activation_bytes"] is not None:
            memory.lines.setdefault(r["mode"], []).append((r["cp"], r["activation_bytes"] / 2**20))
    return [*out, memory]


def worker_main(job_json: str) -> None:
    """The MindSpore msrun worker mode (its threads come from ``HP_MINDSPORE_THREADS``, set by
    ``on_msrun``): measure, write this rank's result."""
    start_watchdog()
    job = json.loads(job_json)
    keep_host_memory(job["keep_host_memory"])
    result = measure_step_mindspore(job)
    write_result(result["rank"], result)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    add = parser.add_argument
    add("--seq-len", type=int, default=8192, help="total T of the fixed-total sweep")
    add("--local-seq-len", type=int, default=2048, help="T/cp of the fixed-local sweep (0: skip)")
    add("--cp-sizes", type=int, nargs="+", default=[1, 2, 4], help="CP sizes of both sweeps")
    add("--modes", nargs="+", default=list(MODES), choices=MODES, help="CP modes to time")
    add(
        "--total-threads",
        type=int,
        default=os.cpu_count() or 1,
        help="threads split over the ranks (default: the machine's cores)",
    )
    add("--repeats", type=int, default=3, help="timed rounds (median reported)")
    add("--warmup", type=int, default=1, help="untimed rounds first")
    add("--batch", type=int, default=1, help="sequences B per step")
    add("--timeout", type=float, default=1800.0, help="seconds per configuration")
    add("--out", type=Path, default=Path("results/bench_cp.json"), help="JSON file of the results")
    add("--backend", nargs="+", default=["torch"], choices=BACKENDS, help="frameworks to time, in turn")
    add(
        "--efficiency-cp", type=int, default=2, help="ranks of the one-core-per-rank efficiency run (0: skip)"
    )
    add("--efficiency-repeats", type=int, default=5, help="timed rounds of the efficiency run")
    add("--skip-sweeps", action="store_true", help="only the efficiency run")
    add("--worker-job", help=argparse.SUPPRESS)  # MindSpore worker mode
    add(
        "--glibc-malloc-defaults",
        action="store_true",
        help="leave glibc's malloc settings alone (default: keep_freed_host_memory() in every process)",
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.worker_job is not None:
        worker_main(args.worker_job)
        return
    kept = keep_host_memory(not args.glibc_malloc_defaults)  # forked ranks inherit it
    shape = asdict(LayerShape(batch=args.batch))
    sweeps = [] if args.skip_sweeps else [("fixed_total", args.seq_len, None)]
    if args.local_seq_len and not args.skip_sweeps:
        sweeps.append(("fixed_local", None, args.local_seq_len))
    if sweeps and (bad := [cp for cp in args.cp_sizes if args.seq_len % cp]):
        raise SystemExit(f"--seq-len {args.seq_len} is not divisible by cp={bad[0]}")
    efficiency = None
    if args.efficiency_cp > 1 and "torch" in args.backend:
        job = {"modes": args.modes, "seq_len": args.seq_len, "shape": shape}
        job.update(repeats=args.efficiency_repeats, warmup=args.warmup)
        efficiency = run_efficiency(args.efficiency_cp, job, timeout_s=args.timeout)
        print_efficiency(efficiency)
    rows = []
    for backend, (sweep, total, local) in ((b, sweep) for b in args.backend for sweep in sweeps):
        for mode, cp in ((m, c) for m in args.modes for c in args.cp_sizes):
            seq_len = total if total is not None else local * cp
            job = {"mode": mode, "seq_len": seq_len, "shape": shape, "repeats": args.repeats}
            job.update(warmup=args.warmup, keep_host_memory=kept)  # kept: for the msrun workers
            threads = max(1, args.total_threads // cp)
            ranks = run_config(backend, cp, threads, job, args.timeout)
            rows.append(config_row(backend, sweep, cp, threads, job, ranks))
            print(f"done {backend} {sweep} {mode} cp={cp}: {rows[-1]['time_s']:.3f}s", flush=True)
    summarize(rows)
    if efficiency is not None:
        print_efficiency(efficiency)
    payload = {"shape": shape, "total_threads": args.total_threads, "freed_host_memory_kept": kept}
    payload.update(rows=rows, efficiency=efficiency, load_average_at_end=load_average())
    write_json(args.out, payload)
    if rows:
        save_png(args.out.with_suffix(".png"), panels(rows))
    print(f"wrote {args.out}" + (f" and {args.out.with_suffix('.png')}" if rows else ""))


if __name__ == "__main__":
    main()
